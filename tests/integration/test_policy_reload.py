"""A policy reload builds only what changed (store/policy_rows.py).

Every change of any policy makes each worker load every layer again (the
snapshot has one version). A layer whose row is the same, column for column,
comes back as the same object: with 10,000 tenants a reload built 10,000
pydantic policies on the event loop (75-97 ms of CPU, BENCHMARKS.md). What
a change touches, directly or through a plan, must still come back new.
"""

from __future__ import annotations

from llmquota.admin.service import AdminService
from llmquota.admission.limiter import Limiter
from llmquota.domain.plans import Plan
from llmquota.domain.policy import Policy
from llmquota.domain.records import CachedLayer
from llmquota.domain.response_cache import CachePolicy

TENANTS = [f"t{i}" for i in range(20)]


def layer(limiter: Limiter, tenant: str, route: str | None = None) -> CachedLayer:
    """The innermost layer a request of `tenant` (on `route`) passes."""
    layers = limiter.policies.layers_for(tenant, route)
    assert layers is not None
    return layers[-1]


async def test_a_reload_keeps_every_unchanged_layer_and_rebuilds_each_changed_one(
    limiter: Limiter,
) -> None:
    admin = AdminService(limiter.store)
    await admin.put_plan("pro", Plan(tokens_per_minute=100_000, fallback_models=["gpt-4o-mini"]))
    for tenant in TENANTS:
        await admin.put_tenant_policy(tenant, None, {"tokens_per_minute": 60_000})
    await admin.put_tenant_policy("t19", "pro", {})
    await admin.put_policy("global", None, None, Policy(tokens_per_minute=10_000_000))
    await limiter.refresh_policies()
    before = {tenant: layer(limiter, tenant) for tenant in TENANTS}
    global_before = limiter.policies.layers_for("t0", None)

    # One tenant's own policy, another's through its plan, a third given a route.
    await admin.put_tenant_policy("t0", None, {"tokens_per_minute": 30_000})
    await admin.put_plan("pro", Plan(tokens_per_minute=100_000, fallback_models=["o3-mini"]))
    await admin.put_policy("route", "t1", "chat", Policy(cache=CachePolicy(mode="exact")))
    await limiter.refresh_policies()
    after = {tenant: layer(limiter, tenant) for tenant in TENANTS}

    kept = [tenant for tenant in TENANTS if after[tenant] is before[tenant]]
    assert kept == TENANTS[1:19]  # t1's tenant layer is unchanged by its new route
    global_after = limiter.policies.layers_for("t0", None)
    assert global_before is not None and global_after is not None
    assert global_before[0].scope == "global" and global_after[0] is global_before[0]
    assert after["t0"].policy.tokens_per_minute == 30_000
    assert after["t19"].fallback_models == ("o3-mini",)
    route = layer(limiter, "t1", "chat")
    assert (route.route, route.policy.cache) == ("chat", CachePolicy(mode="exact"))
