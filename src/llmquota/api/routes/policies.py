"""Policies: the limits of the global layer, of a tenant, of a tenant's route.

Only the admin key sets or reads them. The routes translate between the REST
bodies and the domain's Policy; the admin service stores them and owns the
rules (a route policy needs its tenant registered).
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import APIRouter, Request, Response

from llmquota.admin.service import AdminService
from llmquota.api.dependencies import AdminDep, CallerDep, RouteName, TenantName
from llmquota.api.etags import if_match, set_etag
from llmquota.api.schemas import PolicyBody, PolicyResponse
from llmquota.domain.errors import InvalidRequest, UnknownTenant
from llmquota.domain.policy import Policy
from llmquota.domain.records import StoredPolicy
from llmquota.domain.vocabulary import Scope

router = APIRouter(tags=["policies"])


def _policy(body: PolicyBody) -> Policy:
    fields = body.model_dump(
        exclude_none=True, exclude={"plan", "fallback_models", "prepaid", "shards", "unlimited"}
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


# The fields that limit something: a tenant or route policy sets one (or says
# what its calls count as on the layers above: request_cost, uses_concurrency),
# names a plan, or says "unlimited": true (a body of none is a mistake more
# often than a wish).
LIMIT_FIELDS = (
    "tokens_per_minute",
    "requests_per_minute",
    "max_in_flight",
    "request_cost",
    "uses_concurrency",
)


def check_limited(scope: Scope, body: PolicyBody) -> None:
    """422 for a tenant or route policy with no limit, no plan and no "unlimited": true."""
    if scope == "global" or body.unlimited or body.plan is not None:
        return
    if all(getattr(body, name) is None for name in LIMIT_FIELDS):
        raise InvalidRequest(
            "body: sets no limit (tokens_per_minute, requests_per_minute or max_in_flight), "
            'no request_cost or uses_concurrency and no plan; say "unlimited": true for a '
            "layer without limits"
        )


@dataclass(frozen=True, slots=True)
class PolicyTarget:
    """Which policy a request writes: the global one, a tenant's, or a tenant's route's."""

    scope: Scope
    tenant: str | None = None
    route: str | None = None


async def put_policy(
    admin: AdminService, target: PolicyTarget, body: PolicyBody, if_match: list[str] | None
) -> StoredPolicy:
    """Validate a full policy body and write it; the stored policy after the write.

    `if_match`: PreconditionFailed unless the layer's ETag is one of these,
    checked in the write's own statement.
    """
    scope, tenant, route = target.scope, target.tenant, target.route
    if body.unlimited is not None and scope == "global":
        raise InvalidRequest("unlimited: the global policy is unlimited when it sets no limit")
    if body.plan is not None and scope != "tenant":
        raise InvalidRequest("plan: only a tenant policy may name a plan")
    if body.prepaid is not None and scope != "tenant":
        raise InvalidRequest("prepaid: only a tenant policy (or a plan) may be prepaid")
    if body.fallback_models is not None and scope == "global":
        raise InvalidRequest("fallback_models: set them on a plan, a tenant or a route")
    if body.output_estimate is not None and scope == "global":
        raise InvalidRequest("output_estimate: set it on a plan, a tenant or a route")
    if body.cache is not None and scope == "global":
        raise InvalidRequest("cache: set it on a plan, a tenant or a route")
    if body.admission is not None and scope == "global":
        raise InvalidRequest("admission: set it on a tenant or a route")
    if scope == "global" and (body.request_cost is not None or body.uses_concurrency is not None):
        raise InvalidRequest(
            "request_cost, uses_concurrency: set them on a tenant or a route (what its calls "
            "count as on every layer they meet, the global one included)"
        )
    if body.shards is not None and scope != "global":
        raise InvalidRequest("shards: only the global policy is sharded")
    check_limited(scope, body)
    if scope == "global":
        await _check_shards(admin, body)
    policy = _policy(body)  # checks the limits whatever the plan adds
    if scope == "tenant" and tenant is not None:
        # JSON values: the own policy is stored as jsonb (a cache's hit price as its string).
        own = body.model_dump(mode="json", exclude_none=True, exclude={"plan", "unlimited"})
        await admin.put_tenant_policy(tenant, body.plan, own, if_match=if_match)
    else:
        await admin.put_policy(
            scope,
            tenant,
            route,
            policy,
            fallback_models=body.fallback_models or (),
            shards=body.shards,
            if_match=if_match,
        )
    return await admin.get_policy(scope, tenant, route)


async def _put(
    request: Request,
    response: Response,
    admin: AdminService,
    target: PolicyTarget,
    body: PolicyBody,
) -> PolicyResponse:
    stored = await put_policy(admin, target, body, if_match(request))
    set_etag(response, stored.policy_version)
    return policy_response(stored)


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
    response: Response, admin: AdminService, scope: Scope, tenant: str | None, route: str | None
) -> PolicyResponse:
    stored = await admin.get_policy(scope, tenant, route)
    set_etag(response, stored.policy_version)
    return policy_response(stored)


@router.put("/v1/policies/global", response_model=PolicyResponse)
async def put_global_policy(
    body: PolicyBody, request: Request, response: Response, caller: CallerDep, admin: AdminDep
) -> PolicyResponse:
    """Set the limits every request passes, whatever its tenant ({}: no global limit)."""
    caller.require_admin()
    return await _put(request, response, admin, PolicyTarget("global"), body)


@router.get("/v1/policies/global", response_model=PolicyResponse)
async def get_global_policy(
    response: Response, caller: CallerDep, admin: AdminDep
) -> PolicyResponse:
    """The global limits, with their ETag."""
    caller.require_admin()
    return await _get(response, admin, "global", None, None)


@router.put("/v1/tenants/{tenant}/policy", response_model=PolicyResponse)
async def put_tenant_policy(
    tenant: TenantName,
    body: PolicyBody,
    *,
    request: Request,
    response: Response,
    caller: CallerDep,
    admin: AdminDep,
) -> PolicyResponse:
    """Replace a tenant's limits (registering the tenant if new)."""
    caller.require_admin()
    return await _put(request, response, admin, PolicyTarget("tenant", tenant), body)


@router.get("/v1/tenants/{tenant}/policy", response_model=PolicyResponse)
async def get_tenant_policy(
    tenant: TenantName, response: Response, caller: CallerDep, admin: AdminDep
) -> PolicyResponse:
    """A tenant's limits, with their ETag."""
    caller.require_admin()
    return await _get(response, admin, "tenant", tenant, None)


@router.put("/v1/tenants/{tenant}/routes/{route}/policy", response_model=PolicyResponse)
async def put_route_policy(
    tenant: TenantName,
    route: RouteName,
    body: PolicyBody,
    *,
    request: Request,
    response: Response,
    caller: CallerDep,
    admin: AdminDep,
) -> PolicyResponse:
    """Replace the limits of one route of a tenant."""
    caller.require_admin()
    return await _put(request, response, admin, PolicyTarget("route", tenant, route), body)


@router.get("/v1/tenants/{tenant}/routes/{route}/policy", response_model=PolicyResponse)
async def get_route_policy(
    tenant: TenantName, route: RouteName, response: Response, caller: CallerDep, admin: AdminDep
) -> PolicyResponse:
    """A route's limits, with their ETag."""
    caller.require_admin()
    return await _get(response, admin, "route", tenant, route)
