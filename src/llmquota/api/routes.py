"""The REST endpoints. Each one authenticates, calls the Limiter, and renders.

Paths, fields and status codes are a contract with clients; see README.md.
"""

from __future__ import annotations

import math
import uuid
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Header, Path, Query, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse

from llmquota.admin.service import AdminService
from llmquota.admission.limiter import Limiter
from llmquota.api.auth import Caller
from llmquota.api.headers import rate_limit_headers
from llmquota.api.refusals import refusal_response
from llmquota.api.schemas import (
    AdmitBody,
    AdmitResponse,
    ErrorResponse,
    HeartbeatBody,
    HeartbeatResponse,
    KeyResponse,
    LayerStatusResponse,
    PolicyBody,
    PolicyResponse,
    ReleaseResponse,
    Remaining,
    SettleBody,
    SettleResponse,
    StatusResponse,
    UsageResponse,
)
from llmquota.domain.errors import InvalidRequest
from llmquota.domain.policy import NAME_PATTERN, Policy
from llmquota.domain.refusals import seconds_until_full
from llmquota.domain.vocabulary import Scope


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for error statuses, all in the one error shape."""
    descriptions = {
        400: "the body could not be parsed at all",
        401: "missing or invalid API key",
        403: "the key may not act on this tenant or endpoint",
        404: "no such tenant or reservation (another tenant's looks the same)",
        409: "the reservation's state does not allow this",
        413: "the body is over the size limit, or the reservation can never fit",
        422: "invalid request: wrong types, out-of-range numbers, malformed JSON",
        429: "a limit has no room now; retry after retry_after_ms",
        503: "limiter_unavailable: the database did not answer in time; retryable",
    }
    return {s: {"model": ErrorResponse, "description": descriptions[s]} for s in statuses}


# Every endpoint may answer these: parsing, authentication, body size, validation, outage.
router = APIRouter(responses=_errors(400, 401, 403, 404, 413, 422, 503))

TenantName = Annotated[str, Path(pattern=NAME_PATTERN)]
RouteName = Annotated[str, Path(pattern=NAME_PATTERN)]


def get_limiter(request: Request) -> Limiter:
    limiter: Limiter = request.app.state.limiter
    return limiter


def get_admin(request: Request) -> AdminService:
    admin: AdminService = request.app.state.admin
    return admin


async def get_caller(
    request: Request, authorization: Annotated[str | None, Header()] = None
) -> Caller:
    caller: Caller = await request.app.state.authenticator.caller(authorization)
    return caller


LimiterDep = Annotated[Limiter, Depends(get_limiter)]
AdminDep = Annotated[AdminService, Depends(get_admin)]
CallerDep = Annotated[Caller, Depends(get_caller)]


@router.get("/healthz", tags=["operations"])
async def healthz(admin: AdminDep) -> dict[str, str]:
    """Liveness plus a database round trip, within the decision deadline (else 503)."""
    await admin.ping()
    return {"status": "ok"}


@router.get("/metrics", tags=["operations"], response_class=PlainTextResponse)
async def metrics(limiter: LimiterDep) -> Response:
    """Prometheus metrics of this worker."""
    return Response(limiter.metrics.render(), media_type="text/plain; version=0.0.4")


@router.post(
    "/v1/admit",
    status_code=201,
    response_model=AdmitResponse,
    tags=["admission"],
    responses=_errors(429),
)
async def admit(body: AdmitBody, caller: CallerDep, limiter: LimiterDep) -> JSONResponse:
    """Reserve input + max_tokens on every layer, or say which limit refused."""
    caller.require_tenant(body.tenant)
    prepared = limiter.prepare(
        tenant=body.tenant,
        route=body.route,
        model=body.model,
        max_tokens=body.max_tokens,
        messages=body.messages,
        input_tokens=body.input_tokens,
        lease_seconds=body.lease_seconds,
        idempotency_key=body.idempotency_key,
    )
    admission = await limiter.decide(prepared)
    d = admission.decision
    headers = rate_limit_headers(d.tenant)
    if admission.fallback is not None:
        # Decided by the failure mode while the store was away.
        headers["llmquota-fallback"] = admission.fallback
    refused = refusal_response(body.tenant, d, headers)
    if refused is not None:
        return refused
    admission.raise_for_refusal(body.tenant)  # unknown tenant, idempotency conflict
    assert d.reservation_id is not None and d.lease_expires_at is not None
    response = AdmitResponse(
        reservation_id=str(d.reservation_id),
        reserved_tokens=int(d.reserved_tokens or 0),
        input_tokens=admission.input_tokens,
        input_estimated=admission.input_estimated,
        lease_expires_at=d.lease_expires_at,
        lease_generation=int(d.lease_generation or 1),
        remaining=Remaining(
            tokens=d.remaining_tokens,
            requests=d.remaining_requests,
            in_flight=d.remaining_in_flight,
        ),
    )
    return JSONResponse(response.model_dump(mode="json"), status_code=201, headers=headers)


@router.post(
    "/v1/reservations/{reservation_id}/settle",
    response_model=SettleResponse,
    tags=["admission"],
    responses=_errors(409),
)
async def settle(
    reservation_id: uuid.UUID, body: SettleBody, caller: CallerDep, limiter: LimiterDep
) -> SettleResponse:
    """Charge the provider's reported usage; refund or debit the difference."""
    result = await limiter.settle(
        reservation_id,
        input_tokens=body.input_tokens,
        output_tokens=body.output_tokens,
        outcome=body.outcome,
        caller=caller.scope,
    )
    return SettleResponse(
        charged_tokens=result.charged_tokens,
        refunded_tokens=result.refunded_tokens,
        late=result.late,
    )


@router.post(
    "/v1/reservations/{reservation_id}/release",
    response_model=ReleaseResponse,
    tags=["admission"],
    responses=_errors(409),
)
async def release(
    reservation_id: uuid.UUID, caller: CallerDep, limiter: LimiterDep
) -> ReleaseResponse:
    """Give the whole reservation back: the provider was never called."""
    await limiter.release(reservation_id, caller=caller.scope)
    return ReleaseResponse(released=True)


@router.post(
    "/v1/reservations/{reservation_id}/heartbeat",
    response_model=HeartbeatResponse,
    tags=["admission"],
    responses=_errors(409),
)
async def heartbeat(
    reservation_id: uuid.UUID,
    caller: CallerDep,
    limiter: LimiterDep,
    body: Annotated[HeartbeatBody | None, Body()] = None,
) -> HeartbeatResponse:
    """Extend a live lease."""
    result = await limiter.heartbeat(
        reservation_id,
        lease_seconds=body.lease_seconds if body else None,
        caller=caller.scope,
        lease_generation=body.lease_generation if body else None,
    )
    assert result.lease_expires_at is not None and result.lease_generation is not None
    return HeartbeatResponse(
        lease_expires_at=result.lease_expires_at, lease_generation=result.lease_generation
    )


def _policy(body: PolicyBody) -> Policy:
    fields = body.model_dump(exclude_none=True)
    try:
        return Policy(**fields)
    except ValueError as exc:
        raise InvalidRequest(str(exc).replace("\n", " ")) from exc


def _policy_response(policy: Policy, version: int) -> PolicyResponse:
    resolved = policy.resolved()
    return PolicyResponse(**resolved.model_dump(), policy_version=version)


async def _put(
    admin: AdminService, scope: Scope, tenant: str | None, route: str | None, body: PolicyBody
) -> PolicyResponse:
    policy = _policy(body)
    version = await admin.put_policy(scope, tenant, route, policy)
    return _policy_response(policy, version)


async def _get(
    admin: AdminService, scope: Scope, tenant: str | None, route: str | None
) -> PolicyResponse:
    return _policy_response(*await admin.get_policy(scope, tenant, route))


@router.put("/v1/policies/global", response_model=PolicyResponse, tags=["policies"])
async def put_global_policy(body: PolicyBody, caller: CallerDep, admin: AdminDep) -> PolicyResponse:
    """Set the limits every request passes, whatever its tenant."""
    caller.require_admin()
    return await _put(admin, "global", None, None, body)


@router.get("/v1/policies/global", response_model=PolicyResponse, tags=["policies"])
async def get_global_policy(caller: CallerDep, admin: AdminDep) -> PolicyResponse:
    """The global limits."""
    caller.require_admin()
    return await _get(admin, "global", None, None)


@router.put("/v1/tenants/{tenant}/policy", response_model=PolicyResponse, tags=["policies"])
async def put_tenant_policy(
    tenant: TenantName, body: PolicyBody, caller: CallerDep, admin: AdminDep
) -> PolicyResponse:
    """Set a tenant's limits (registering the tenant if new)."""
    caller.require_admin()
    return await _put(admin, "tenant", tenant, None, body)


@router.get("/v1/tenants/{tenant}/policy", response_model=PolicyResponse, tags=["policies"])
async def get_tenant_policy(
    tenant: TenantName, caller: CallerDep, admin: AdminDep
) -> PolicyResponse:
    """A tenant's limits."""
    caller.require_admin()
    return await _get(admin, "tenant", tenant, None)


@router.put(
    "/v1/tenants/{tenant}/routes/{route}/policy", response_model=PolicyResponse, tags=["policies"]
)
async def put_route_policy(
    tenant: TenantName, route: RouteName, body: PolicyBody, caller: CallerDep, admin: AdminDep
) -> PolicyResponse:
    """Set the limits of one route of a tenant."""
    caller.require_admin()
    return await _put(admin, "route", tenant, route, body)


@router.get(
    "/v1/tenants/{tenant}/routes/{route}/policy", response_model=PolicyResponse, tags=["policies"]
)
async def get_route_policy(
    tenant: TenantName, route: RouteName, caller: CallerDep, admin: AdminDep
) -> PolicyResponse:
    """A route's limits."""
    caller.require_admin()
    return await _get(admin, "route", tenant, route)


@router.post(
    "/v1/tenants/{tenant}/keys", status_code=201, response_model=KeyResponse, tags=["tenants"]
)
async def create_key(tenant: TenantName, caller: CallerDep, admin: AdminDep) -> KeyResponse:
    """Issue an API key for a tenant (registering it if new). Shown once."""
    caller.require_admin()
    key = await admin.create_key(tenant)
    return KeyResponse(key=key, tenant=tenant)


@router.get("/v1/tenants/{tenant}/status", response_model=StatusResponse, tags=["tenants"])
async def tenant_status(tenant: TenantName, caller: CallerDep, admin: AdminDep) -> StatusResponse:
    """Every layer the tenant's requests pass, with balances refilled to now."""
    caller.require_tenant(tenant)
    layers = await admin.tenant_status(tenant)
    return StatusResponse(
        tenant=tenant,
        layers=[
            LayerStatusResponse(
                scope=layer.scope,
                route=layer.route,
                limits=_policy_response(layer.policy, layer.policy_version),
                remaining_tokens=None if layer.tokens is None else math.floor(layer.tokens),
                remaining_requests=None if layer.requests is None else math.floor(layer.requests),
                in_flight=layer.in_flight,
                tokens_full_in_seconds=seconds_until_full(
                    layer.tokens, layer.policy.token_burst, layer.policy.tokens_per_minute
                ),
                requests_full_in_seconds=seconds_until_full(
                    layer.requests, layer.policy.request_burst, layer.policy.requests_per_minute
                ),
            )
            for layer in layers
        ],
    )


@router.get("/v1/tenants/{tenant}/usage", response_model=UsageResponse, tags=["tenants"])
async def tenant_usage(
    tenant: TenantName,
    caller: CallerDep,
    admin: AdminDep,
    from_: Annotated[datetime | None, Query(alias="from")] = None,
    to: Annotated[datetime | None, Query()] = None,
) -> JSONResponse:
    """Ledger totals for [from, to); default: the last 30 days."""
    caller.require_tenant(tenant)
    end = _aware(to) if to else datetime.now(UTC)
    start = _aware(from_) if from_ else end - timedelta(days=30)
    totals = await admin.tenant_usage(tenant, start, end)
    body = UsageResponse(
        tenant=tenant,
        from_=start,
        to=end,
        requests=totals.requests,
        input_tokens=totals.input_tokens,
        output_tokens=totals.output_tokens,
    )
    return JSONResponse(body.model_dump(mode="json", by_alias=True))


def _aware(moment: datetime) -> datetime:
    """Naive timestamps in a query are taken as UTC."""
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)
