"""Policies: the limits of the global layer, of a tenant, of a tenant's route.

Only the admin key sets or reads them. The routes translate between the REST
bodies and the domain's Policy; the admin service stores them and owns the
rules (a route policy needs its tenant registered).
"""

from __future__ import annotations

from fastapi import APIRouter

from llmquota.admin.service import AdminService
from llmquota.api.dependencies import AdminDep, CallerDep, RouteName, TenantName
from llmquota.api.schemas import PolicyBody, PolicyResponse
from llmquota.domain.errors import InvalidRequest, UnknownTenant
from llmquota.domain.policy import Policy
from llmquota.domain.records import StoredPolicy
from llmquota.domain.vocabulary import Scope

router = APIRouter(tags=["policies"])


def _policy(body: PolicyBody) -> Policy:
    fields = body.model_dump(
        exclude_none=True, exclude={"plan", "fallback_models", "prepaid", "shards"}
    )
    try:
        return Policy(**fields)
    except ValueError as exc:
        raise InvalidRequest(str(exc).replace("\n", " ")) from exc


def policy_response(stored: StoredPolicy) -> PolicyResponse:
    """A policy as the API shows it: every limit resolved, with its version and plan."""
    resolved = stored.policy.resolved()
    return PolicyResponse(
        **resolved.model_dump(),
        policy_version=stored.policy_version,
        plan=stored.plan,
        fallback_models=list(stored.fallback_models),
        prepaid=stored.prepaid,
        shards=stored.shards,
    )


async def _put(
    admin: AdminService, scope: Scope, tenant: str | None, route: str | None, body: PolicyBody
) -> PolicyResponse:
    if body.plan is not None and scope != "tenant":
        raise InvalidRequest("plan: only a tenant policy may name a plan")
    if body.prepaid is not None and scope != "tenant":
        raise InvalidRequest("prepaid: only a tenant policy (or a plan) may be prepaid")
    if body.fallback_models is not None and scope == "global":
        raise InvalidRequest("fallback_models: set them on a plan, a tenant or a route")
    if body.output_estimate is not None and scope == "global":
        raise InvalidRequest("output_estimate: set it on a plan, a tenant or a route")
    if body.shards is not None and scope != "global":
        raise InvalidRequest("shards: only the global policy is sharded")
    if scope == "global":
        await _check_shards(admin, body)
    policy = _policy(body)  # checks the limits whatever the plan adds
    if scope == "tenant" and tenant is not None:
        own = body.model_dump(exclude_none=True, exclude={"plan"})
        await admin.put_tenant_policy(tenant, body.plan, own)
    else:
        await admin.put_policy(
            scope,
            tenant,
            route,
            policy,
            fallback_models=body.fallback_models or (),
            shards=body.shards,
        )
    return await _get(admin, scope, tenant, route)


async def _check_shards(admin: AdminService, body: PolicyBody) -> None:
    """Shards split the global layer's limits: each shard needs at least one of each.

    A body without `shards` keeps the current count, so it is checked against that.
    """
    shards = body.shards
    if shards is None:
        try:
            shards = (await admin.get_policy("global", None, None)).shards
        except UnknownTenant:
            shards = 1  # no global policy yet
    if shards > 1 and body.max_in_flight is not None:
        raise InvalidRequest(
            "shards: a sharded global layer has no max_in_flight (permits are counted per row); "
            "cap concurrency on tenants, routes or provider ceilings"
        )
    for name in ("tokens_per_minute", "token_burst", "requests_per_minute", "request_burst"):
        value = getattr(body, name)
        if value is not None and value < shards:
            raise InvalidRequest(f"shards: {name} {value} cannot be split over {shards} shards")


async def _get(
    admin: AdminService, scope: Scope, tenant: str | None, route: str | None
) -> PolicyResponse:
    return policy_response(await admin.get_policy(scope, tenant, route))


@router.put("/v1/policies/global", response_model=PolicyResponse)
async def put_global_policy(body: PolicyBody, caller: CallerDep, admin: AdminDep) -> PolicyResponse:
    """Set the limits every request passes, whatever its tenant."""
    caller.require_admin()
    return await _put(admin, "global", None, None, body)


@router.get("/v1/policies/global", response_model=PolicyResponse)
async def get_global_policy(caller: CallerDep, admin: AdminDep) -> PolicyResponse:
    """The global limits."""
    caller.require_admin()
    return await _get(admin, "global", None, None)


@router.put("/v1/tenants/{tenant}/policy", response_model=PolicyResponse)
async def put_tenant_policy(
    tenant: TenantName, body: PolicyBody, caller: CallerDep, admin: AdminDep
) -> PolicyResponse:
    """Set a tenant's limits (registering the tenant if new)."""
    caller.require_admin()
    return await _put(admin, "tenant", tenant, None, body)


@router.get("/v1/tenants/{tenant}/policy", response_model=PolicyResponse)
async def get_tenant_policy(
    tenant: TenantName, caller: CallerDep, admin: AdminDep
) -> PolicyResponse:
    """A tenant's limits."""
    caller.require_admin()
    return await _get(admin, "tenant", tenant, None)


@router.put("/v1/tenants/{tenant}/routes/{route}/policy", response_model=PolicyResponse)
async def put_route_policy(
    tenant: TenantName, route: RouteName, body: PolicyBody, caller: CallerDep, admin: AdminDep
) -> PolicyResponse:
    """Set the limits of one route of a tenant."""
    caller.require_admin()
    return await _put(admin, "route", tenant, route, body)


@router.get("/v1/tenants/{tenant}/routes/{route}/policy", response_model=PolicyResponse)
async def get_route_policy(
    tenant: TenantName, route: RouteName, caller: CallerDep, admin: AdminDep
) -> PolicyResponse:
    """A route's limits."""
    caller.require_admin()
    return await _get(admin, "route", tenant, route)
