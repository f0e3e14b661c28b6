"""Tenants: their live status, their usage (their keys: routes/keys.py).

A tenant (or the admin) reads its own status and
usage. The admin service answers; these routes only parse the query and
render its records, so the REST bodies stay what clients parse.

A tenant sees only its own figures: of a layer shared with other tenants
(the global one) its status says whether that layer binds it now and when to
retry, never the layer's limits, balances or in-flight count, which describe
other customers' traffic.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse

from llmquota.api.auth import Caller
from llmquota.api.dependencies import AdminDep, CallerDep, LimiterDep, TenantName
from llmquota.api.routes.policies import policy_response
from llmquota.api.schemas import (
    LayerStatusResponse,
    PathUsageResponse,
    StatusResponse,
    UsageResponse,
)
from llmquota.domain.json_text import DateTime
from llmquota.domain.records import LayerStatus, StoredPolicy
from llmquota.domain.refusals import binding_retry_ms, seconds_until_full

router = APIRouter(tags=["tenants"])
# The usage range when the query names none.
DEFAULT_USAGE_DAYS = 30


@router.get("/v1/tenants/{tenant}/status", response_model=StatusResponse)
async def tenant_status(
    tenant: TenantName, caller: CallerDep, admin: AdminDep, limiter: LimiterDep
) -> StatusResponse:
    """Every layer the tenant's requests pass, with balances refilled to now.

    With a tenant key, a shared layer (global) shows only `binding` and
    `retry_after_ms`.
    """
    caller.require_tenant(tenant)
    caller.require_scope("read")
    layers = await admin.tenant_status(tenant)
    retry_ms = limiter.settings.concurrency_retry_ms
    plan = next((layer.plan for layer in layers if layer.scope == "tenant"), None)
    return StatusResponse(
        tenant=tenant,
        plan=plan,
        layers=[_layer_status(layer, caller, retry_ms) for layer in layers],
    )


def _layer_status(layer: LayerStatus, caller: Caller, retry_ms: int) -> LayerStatusResponse:
    retry_after_ms = binding_retry_ms(layer, retry_ms)
    if layer.tenant is None and not caller.is_admin:
        # Shared with other tenants: their traffic is not this caller's to see.
        return LayerStatusResponse(
            scope=layer.scope,
            route=layer.route,
            limits=None,
            remaining_tokens=None,
            remaining_requests=None,
            in_flight=None,
            tokens_full_in_seconds=None,
            requests_full_in_seconds=None,
            binding=retry_after_ms is not None,
            retry_after_ms=retry_after_ms,
        )
    return LayerStatusResponse(
        scope=layer.scope,
        route=layer.route,
        limits=policy_response(
            StoredPolicy(
                layer.policy,
                layer.policy_version,
                layer.plan,
                fallback_models=layer.fallback_models,
                prepaid=layer.prepaid,
                shards=layer.shards,
            )
        ),
        remaining_tokens=None if layer.tokens is None else math.floor(layer.tokens),
        remaining_requests=None if layer.requests is None else math.floor(layer.requests),
        allotted_tokens=layer.allotted_tokens,
        allotted_requests=layer.allotted_requests,
        in_flight=layer.in_flight,
        tokens_full_in_seconds=seconds_until_full(
            layer.tokens, layer.policy.token_burst, layer.policy.tokens_per_minute
        ),
        requests_full_in_seconds=seconds_until_full(
            layer.requests, layer.policy.request_burst, layer.policy.requests_per_minute
        ),
        binding=retry_after_ms is not None,
        retry_after_ms=retry_after_ms,
    )


@router.get("/v1/tenants/{tenant}/usage", response_model=UsageResponse)
async def tenant_usage(
    tenant: TenantName,
    caller: CallerDep,
    admin: AdminDep,
    from_: Annotated[DateTime | None, Query(alias="from")] = None,
    to: Annotated[DateTime | None, Query()] = None,
) -> JSONResponse:
    """Ledger totals for [from, to), RFC 3339 date-times; default: the last 30 days."""
    caller.require_tenant(tenant)
    caller.require_scope("read")
    end = to or datetime.now(UTC)
    start = from_ or _days_before(end, DEFAULT_USAGE_DAYS)
    totals = await admin.tenant_usage(tenant, start, end)
    body = UsageResponse(
        tenant=tenant,
        from_=start,
        to=end,
        requests=totals.requests,
        input_tokens=totals.input_tokens,
        output_tokens=totals.output_tokens,
        by_serving_path={
            path: PathUsageResponse(
                requests=usage.requests,
                input_tokens=usage.input_tokens,
                output_tokens=usage.output_tokens,
                saved_input_tokens=usage.saved_input_tokens,
                saved_output_tokens=usage.saved_output_tokens,
            )
            for path, usage in totals.by_serving_path.items()
        },
    )
    return JSONResponse(body.model_dump(mode="json", by_alias=True))


def _days_before(moment: datetime, days: int) -> datetime:
    """`days` before `moment`, or the earliest datetime when that is before year 1."""
    try:
        return moment - timedelta(days=days)
    except OverflowError:
        return datetime.min.replace(tzinfo=UTC)
