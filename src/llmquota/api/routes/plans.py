"""Plans (tiers) and provider ceilings: admin endpoints.

A plan change reaches every tenant on it at once (one transaction, a new
policy_version for each); a ceiling is one more layer every request for its
models passes, decided in the admission statement itself.
"""

from __future__ import annotations

import math

from fastapi import APIRouter, Response

from llmquota.api.dependencies import AdminDep, CallerDep, RouteName, error_responses
from llmquota.api.plan_schemas import CeilingList, CeilingResponse, PlanList, PlanResponse
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
        policy_version=stored.policy_version,
        remaining_tokens=None if stored.tokens is None else math.floor(stored.tokens),
        remaining_requests=None if stored.requests is None else math.floor(stored.requests),
        in_flight=stored.in_flight,
        utilization=None if stored.utilization is None else round(stored.utilization, 6),
    )


@router.put("/v1/plans/{plan}", response_model=PlanResponse)
async def put_plan(plan: PlanName, body: Plan, caller: CallerDep, admin: AdminDep) -> PlanResponse:
    """Create or replace a plan; every tenant on it changes at once."""
    caller.require_admin()
    await admin.put_plan(plan, body)
    return _plan_response((await admin.plans(plan))[0])


@router.get("/v1/plans", response_model=PlanList)
async def list_plans(caller: CallerDep, admin: AdminDep) -> PlanList:
    """Every plan."""
    caller.require_admin()
    return PlanList(plans=[_plan_response(p) for p in await admin.plans()])


@router.get("/v1/plans/{plan}", response_model=PlanResponse)
async def get_plan(plan: PlanName, caller: CallerDep, admin: AdminDep) -> PlanResponse:
    """One plan."""
    caller.require_admin()
    return _plan_response((await admin.plans(plan))[0])


@router.delete(
    "/v1/plans/{plan}", status_code=204, response_class=Response, responses=error_responses(409)
)
async def delete_plan(plan: PlanName, caller: CallerDep, admin: AdminDep) -> Response:
    """Delete a plan no tenant is on (409 while one is)."""
    caller.require_admin()
    await admin.delete_plan(plan)
    return Response(status_code=204)


@router.put("/v1/ceilings/{ceiling}", response_model=CeilingResponse)
async def put_ceiling(
    ceiling: CeilingName, body: Ceiling, caller: CallerDep, admin: AdminDep
) -> CeilingResponse:
    """Create or replace a provider ceiling for the models it names."""
    caller.require_admin()
    await admin.put_ceiling(ceiling, body)
    return _ceiling_response((await admin.ceilings(ceiling))[0])


@router.get("/v1/ceilings", response_model=CeilingList)
async def list_ceilings(caller: CallerDep, admin: AdminDep) -> CeilingList:
    """Every provider ceiling, with its utilization now."""
    caller.require_admin()
    return CeilingList(ceilings=[_ceiling_response(c) for c in await admin.ceilings()])


@router.get("/v1/ceilings/{ceiling}", response_model=CeilingResponse)
async def get_ceiling(ceiling: CeilingName, caller: CallerDep, admin: AdminDep) -> CeilingResponse:
    """One provider ceiling, with its utilization now."""
    caller.require_admin()
    return _ceiling_response((await admin.ceilings(ceiling))[0])


@router.delete("/v1/ceilings/{ceiling}", status_code=204, response_class=Response)
async def delete_ceiling(ceiling: CeilingName, caller: CallerDep, admin: AdminDep) -> Response:
    """Delete a provider ceiling."""
    caller.require_admin()
    await admin.delete_ceiling(ceiling)
    return Response(status_code=204)
