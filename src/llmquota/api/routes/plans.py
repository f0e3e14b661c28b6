"""Plans (tiers) and provider ceilings: admin endpoints.

A plan change reaches every tenant on it at once (one transaction, a new
policy_version for each); a ceiling is one more layer every request for its
models passes, decided in the admission statement itself.
"""

from __future__ import annotations

import math
from decimal import Decimal
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response

from llmquota.admin.service import AdminService
from llmquota.api.dependencies import AdminDep, CallerDep, RouteName, error_responses
from llmquota.api.etags import if_match, set_etag
from llmquota.api.plan_schemas import (
    ActiveTenantsResponse,
    CeilingList,
    CeilingResponse,
    OversubscriptionResponse,
    OversubscriptionRuleResponse,
    PlanList,
    PlanResponse,
)
from llmquota.api.proxy.upstream import Proxy
from llmquota.api.routes.policy_patch import merged_write, patch_body, validated
from llmquota.domain.errors import InvalidRequest
from llmquota.domain.oversubscription import (
    DEFAULT_DAYS,
    MAX_DAYS,
    CeilingOversubscription,
    OversubscriptionRule,
)
from llmquota.domain.plans import Ceiling, Plan, StoredCeiling, StoredPlan

router = APIRouter(tags=["plans and ceilings"])

# Plan and ceiling names follow the tenant and route name pattern.
PlanName = RouteName
CeilingName = RouteName


def _plan_response(stored: StoredPlan) -> PlanResponse:
    plan = stored.plan
    return PlanResponse(
        plan=stored.name,
        priority=plan.priority,
        tokens_per_minute=plan.tokens_per_minute,
        token_burst=plan.effective_token_burst,
        requests_per_minute=plan.requests_per_minute,
        request_burst=plan.effective_request_burst,
        max_in_flight=plan.max_in_flight,
        lease_seconds=plan.lease_seconds,
        failure_mode=plan.failure_mode,
        fallback_models=list(plan.fallback_models),
        prepaid=plan.prepaid,
        output_estimate=plan.output_estimate,
        cache=plan.cache,
        admission=plan.admission,
        tenants=stored.tenants,
    )


def _ceiling_response(stored: StoredCeiling) -> CeilingResponse:
    c = stored.ceiling
    return CeilingResponse(
        ceiling=stored.name,
        models=list(c.models),
        tokens_per_minute=c.tokens_per_minute,
        token_burst=c.effective_token_burst,
        requests_per_minute=c.requests_per_minute,
        request_burst=c.effective_request_burst,
        max_in_flight=c.max_in_flight,
        shed=list(c.shed),
        upstream=c.upstream,
        policy_version=stored.policy_version,
        remaining_tokens=None if stored.tokens is None else math.floor(stored.tokens),
        remaining_requests=None if stored.requests is None else math.floor(stored.requests),
        in_flight=stored.in_flight,
        utilization=None if stored.utilization is None else round(stored.utilization, 6),
        alert_at=None if c.alert_at is None else list(c.alert_at),
        alert_thresholds=list(c.alert_thresholds),
        alert_hysteresis=c.alert_hysteresis,
        alert_quiet_seconds=c.alert_quiet_seconds,
    )


def _check_upstream(request: Request, ceiling: Ceiling) -> None:
    """A ceiling scoped to a deployment names one this server's proxy knows, when it
    has upstreams: a typo would leave the ceiling bounding nothing."""
    proxy: Proxy = request.app.state.proxy
    if ceiling.upstream is not None and proxy.upstreams and ceiling.upstream not in proxy.upstreams:
        known = ", ".join(sorted(proxy.upstreams))
        raise InvalidRequest(
            f"upstream: no upstream named {ceiling.upstream!r} in this server's upstreams ({known})"
        )


async def _stored_plan(admin: AdminService, name: str, response: Response) -> PlanResponse:
    stored = (await admin.plans(name))[0]
    set_etag(response, stored.version)
    return _plan_response(stored)


async def _stored_ceiling(admin: AdminService, name: str, response: Response) -> CeilingResponse:
    stored = (await admin.ceilings(name))[0]
    set_etag(response, stored.policy_version)
    return _ceiling_response(stored)


@router.put("/v1/plans/{plan}", response_model=PlanResponse, responses=error_responses(412))
async def put_plan(
    plan: PlanName,
    body: Plan,
    *,
    request: Request,
    response: Response,
    caller: CallerDep,
    admin: AdminDep,
) -> PlanResponse:
    """Create or replace a plan; every tenant on it changes at once."""
    caller.require_admin()
    await admin.put_plan(plan, body, if_match=if_match(request))
    return await _stored_plan(admin, plan, response)


@router.patch(
    "/v1/plans/{plan}",
    response_model=PlanResponse,
    responses=error_responses(412, 415),
    openapi_extra=patch_body("Plan"),
)
async def patch_plan(
    plan: PlanName, request: Request, response: Response, caller: CallerDep, admin: AdminDep
) -> PlanResponse:
    """Change some of a plan's fields (JSON Merge Patch; null: back to the default)."""
    caller.require_admin()

    async def stored() -> tuple[dict[str, Any], int]:
        found = (await admin.plans(plan))[0]
        return found.plan.model_dump(mode="json", exclude_none=True), found.version

    async def write(document: dict[str, Any], version: str) -> None:
        await admin.put_plan(plan, validated(Plan, document), if_match=[version])

    await merged_write(request, Plan, f"plan {plan!r}", stored, write)
    return await _stored_plan(admin, plan, response)


@router.get("/v1/plans", response_model=PlanList)
async def list_plans(caller: CallerDep, admin: AdminDep) -> PlanList:
    """Every plan."""
    caller.require_admin()
    return PlanList(plans=[_plan_response(p) for p in await admin.plans()])


@router.get("/v1/plans/{plan}", response_model=PlanResponse)
async def get_plan(
    plan: PlanName, response: Response, caller: CallerDep, admin: AdminDep
) -> PlanResponse:
    """One plan, with its ETag."""
    caller.require_admin()
    return await _stored_plan(admin, plan, response)


@router.delete(
    "/v1/plans/{plan}", status_code=204, response_class=Response, responses=error_responses(409)
)
async def delete_plan(plan: PlanName, caller: CallerDep, admin: AdminDep) -> Response:
    """Delete a plan no tenant is on (409 while one is)."""
    caller.require_admin()
    await admin.delete_plan(plan)
    return Response(status_code=204)


@router.put(
    "/v1/ceilings/{ceiling}", response_model=CeilingResponse, responses=error_responses(412)
)
async def put_ceiling(
    ceiling: CeilingName,
    body: Ceiling,
    *,
    request: Request,
    response: Response,
    caller: CallerDep,
    admin: AdminDep,
) -> CeilingResponse:
    """Create or replace a provider ceiling for the models it names."""
    caller.require_admin()
    _check_upstream(request, body)
    await admin.put_ceiling(ceiling, body, if_match=if_match(request))
    return await _stored_ceiling(admin, ceiling, response)


@router.patch(
    "/v1/ceilings/{ceiling}",
    response_model=CeilingResponse,
    responses=error_responses(412, 415),
    openapi_extra=patch_body("Ceiling"),
)
async def patch_ceiling(
    ceiling: CeilingName, request: Request, response: Response, caller: CallerDep, admin: AdminDep
) -> CeilingResponse:
    """Change some of a ceiling's fields (JSON Merge Patch; null: back to no limit)."""
    caller.require_admin()

    async def stored() -> tuple[dict[str, Any], int]:
        found = (await admin.ceilings(ceiling))[0]
        return found.ceiling.model_dump(mode="json", exclude_none=True), found.policy_version

    async def write(document: dict[str, Any], version: str) -> None:
        body = validated(Ceiling, document)
        _check_upstream(request, body)
        await admin.put_ceiling(ceiling, body, if_match=[version])

    await merged_write(request, Ceiling, f"ceiling {ceiling!r}", stored, write)
    return await _stored_ceiling(admin, ceiling, response)


@router.get("/v1/ceilings", response_model=CeilingList)
async def list_ceilings(caller: CallerDep, admin: AdminDep) -> CeilingList:
    """Every provider ceiling, with its utilization now."""
    caller.require_admin()
    return CeilingList(ceilings=[_ceiling_response(c) for c in await admin.ceilings()])


@router.get("/v1/ceilings/{ceiling}", response_model=CeilingResponse)
async def get_ceiling(
    ceiling: CeilingName, response: Response, caller: CallerDep, admin: AdminDep
) -> CeilingResponse:
    """One provider ceiling, with its utilization now and its ETag."""
    caller.require_admin()
    return await _stored_ceiling(admin, ceiling, response)


@router.get(
    "/v1/ceilings/{ceiling}/oversubscription",
    response_model=OversubscriptionResponse,
    responses=error_responses(404),
)
async def get_ceiling_oversubscription(
    ceiling: CeilingName,
    caller: CallerDep,
    admin: AdminDep,
    days: Annotated[
        int, Query(ge=1, le=MAX_DAYS, description="the period: the last `days` days up to now")
    ] = DEFAULT_DAYS,
) -> OversubscriptionResponse:
    """How oversubscribed the ceiling is: the tenant limits that can reach it against it,
    the tenants active per minute over the period (p50, p95, max) and a verdict."""
    caller.require_admin()
    (found,) = await admin.ceiling_oversubscription(ceiling, days)
    return _oversubscription_response(found, days, admin.oversubscription_rule)


def _oversubscription_response(
    o: CeilingOversubscription, days: int, rule: OversubscriptionRule
) -> OversubscriptionResponse:
    return OversubscriptionResponse(
        ceiling=o.ceiling,
        days=days,
        period_start=o.period_start,
        period_end=o.period_end,
        tenants=o.tenants,
        tenants_without_token_limit=o.tenants_without_token_limit,
        tenants_without_request_limit=o.tenants_without_request_limit,
        tokens_per_minute=o.tokens_per_minute,
        sum_tenant_tokens_per_minute=o.sum_tenant_tokens_per_minute,
        ratio=_number(o.ratio),
        requests_per_minute=o.requests_per_minute,
        sum_tenant_requests_per_minute=o.sum_tenant_requests_per_minute,
        requests_ratio=_number(o.requests_ratio),
        active_minutes=o.active_minutes,
        active_tenants=ActiveTenantsResponse(
            p50=o.active_tenants.p50, p95=o.active_tenants.p95, max=o.active_tenants.max
        ),
        effective_tokens_per_minute=o.effective_tokens_per_minute,
        effective_ratio=_number(o.effective_ratio),
        effective_requests_per_minute=o.effective_requests_per_minute,
        effective_requests_ratio=_number(o.effective_requests_ratio),
        verdict=o.verdict,
        rule=OversubscriptionRuleResponse(
            warn_above=rule.warn_above, critical_above=rule.critical_above
        ),
    )


def _number(ratio: Decimal | None) -> float | None:
    """A ratio of two decimals as a JSON number (2.78 is written 2.78)."""
    return None if ratio is None else float(ratio)


@router.delete("/v1/ceilings/{ceiling}", status_code=204, response_class=Response)
async def delete_ceiling(ceiling: CeilingName, caller: CallerDep, admin: AdminDep) -> Response:
    """Delete a provider ceiling."""
    caller.require_admin()
    await admin.delete_ceiling(ceiling)
    return Response(status_code=204)
