"""Plans, tenant policies on them, the global policy, provider ceilings: their statements.

The same thin connector as the Store (one named statement per method, one
round trip, typed records back), for the administration of the layers that
the admission statement reads. The atomic work (recomputing every tenant of
a plan in the plan's transaction) is in sql/plans.sql.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from decimal import Decimal
from typing import Any

from llmquota.domain.errors import PreconditionFailed
from llmquota.domain.output_estimates import parse_output_estimate
from llmquota.domain.oversubscription import (
    ActiveTenants,
    CeilingOversubscription,
    OversubscriptionRule,
    verdict_of,
)
from llmquota.domain.plans import Ceiling, Plan, ShedStep, StoredCeiling, StoredPlan
from llmquota.domain.policy import Policy
from llmquota.domain.response_cache import parse_cache_policy
from llmquota.domain.vocabulary import PRIORITIES, priority_of, priority_rank
from llmquota.store.connection import Row
from llmquota.store.pool import DeadlinePool


class Catalog:
    """Typed access to the plan and ceiling statements."""

    def __init__(self, pool: DeadlinePool, sql: dict[str, str]) -> None:
        self._pool = pool
        self._sql = sql

    async def _fetch(self, name: str, *args: Any, deadline_seconds: float | None) -> list[Row]:
        return await self._pool.fetch(self._sql[name], args, deadline_seconds=deadline_seconds)

    async def put_tenant_policy(
        self,
        tenant: str,
        plan: str | None,
        own: dict[str, Any],
        *,
        if_match: Sequence[str] | None = None,
        deadline_seconds: float | None = None,
    ) -> int | None:
        """Set a tenant's own fields and plan; its policy version, None for an unknown plan.

        `if_match` (ETags, or "*"): PreconditionFailed unless the layer's is one of them,
        checked and written in one statement.
        """
        rows = await self._fetch(
            "put_tenant_policy",
            tenant,
            plan,
            json.dumps(own),
            _etags(if_match),
            deadline_seconds=deadline_seconds,
        )
        if not rows[0]["precondition_met"]:
            raise PreconditionFailed(f"the policy of tenant {tenant!r} changed since that ETag")
        version = rows[0]["policy_version"]
        return None if version is None else int(version)

    async def put_global_policy(
        self,
        policy: Policy,
        shards: int | None,
        *,
        if_match: Sequence[str] | None = None,
        deadline_seconds: float | None = None,
    ) -> int:
        """Set the global layer's limits, split over `shards` rows (None: as many as now).

        `if_match`: as put_tenant_policy's.
        """
        p = policy.resolved()
        rows = await self._fetch(
            "put_global_policy",
            p.tokens_per_minute,
            p.token_burst,
            p.requests_per_minute,
            p.request_burst,
            p.max_in_flight,
            p.lease_seconds,
            p.failure_mode,
            shards,
            _etags(if_match),
            deadline_seconds=deadline_seconds,
        )
        if not rows[0]["precondition_met"]:
            raise PreconditionFailed("the global policy changed since that ETag")
        return int(rows[0]["policy_version"])

    async def put_plan(
        self,
        name: str,
        plan: Plan,
        *,
        if_match: Sequence[str] | None = None,
        deadline_seconds: float | None = None,
    ) -> int:
        """Create or replace a plan; how many tenants it changed.

        `if_match`: PreconditionFailed unless the plan's ETag is one of these.
        """
        p = plan.resolved()
        rows = await self._fetch(
            "put_plan",
            name,
            priority_rank(plan.priority),
            p.tokens_per_minute,
            p.token_burst,
            p.requests_per_minute,
            p.request_burst,
            p.max_in_flight,
            p.lease_seconds,
            p.failure_mode,
            list(plan.fallback_models),
            plan.prepaid,
            None if plan.output_estimate is None else plan.output_estimate.model_dump_json(),
            _etags(if_match),
            None if plan.cache is None else plan.cache.model_dump_json(),
            plan.admission,
            deadline_seconds=deadline_seconds,
        )
        if not rows[0]["precondition_met"]:
            raise PreconditionFailed(f"plan {name!r} changed since that ETag")
        return int(rows[0]["tenants"])

    async def get_plans(
        self, name: str | None = None, *, deadline_seconds: float | None = None
    ) -> list[StoredPlan]:
        """One plan (or none), or every plan when `name` is None."""
        rows = await self._fetch("get_plans", name, deadline_seconds=deadline_seconds)
        return [
            StoredPlan(
                name=row["plan"],
                plan=Plan(
                    priority=priority_of(row["priority"]),
                    tokens_per_minute=row["tokens_per_minute"],
                    token_burst=row["token_burst"],
                    requests_per_minute=row["requests_per_minute"],
                    request_burst=row["request_burst"],
                    max_in_flight=row["max_in_flight"],
                    lease_seconds=row["lease_seconds"],
                    failure_mode=row["failure_mode"],
                    fallback_models=list(row["fallback_models"]),
                    prepaid=row["prepaid"],
                    output_estimate=parse_output_estimate(row["output_estimate"]),
                    cache=parse_cache_policy(row["cache"]),
                    admission=row["admission"],
                ),
                tenants=int(row["tenants"]),
                version=int(row["version"]),
            )
            for row in rows
        ]

    async def delete_plan(self, name: str, *, deadline_seconds: float | None = None) -> str:
        """'deleted', 'in_use' (tenants are on it) or 'not_found'."""
        rows = await self._fetch("delete_plan", name, deadline_seconds=deadline_seconds)
        return str(rows[0]["status"])

    async def put_ceiling(
        self,
        name: str,
        ceiling: Ceiling,
        *,
        if_match: Sequence[str] | None = None,
        deadline_seconds: float | None = None,
    ) -> int:
        """Create or replace a provider ceiling; its policy version.

        `if_match`: PreconditionFailed unless the ceiling's ETag is one of these.
        """
        rows = await self._fetch(
            "put_ceiling",
            name,
            list(ceiling.models),
            ceiling.tokens_per_minute,
            ceiling.effective_token_burst,
            ceiling.requests_per_minute,
            ceiling.effective_request_burst,
            ceiling.max_in_flight,
            [float(step.above) for step in ceiling.shed],
            [step.admit_mask for step in ceiling.shed],
            [step.small_request_tokens for step in ceiling.shed],
            _etags(if_match),
            None if ceiling.alert_at is None else [Decimal(str(t)) for t in ceiling.alert_at],
            ceiling.alert_hysteresis,
            ceiling.alert_quiet_seconds,
            _queue_steps(ceiling),
            ceiling.upstream,
            deadline_seconds=deadline_seconds,
        )
        if not rows[0]["precondition_met"]:
            raise PreconditionFailed(f"ceiling {name!r} changed since that ETag")
        return int(rows[0]["policy_version"])

    async def get_ceilings(
        self, name: str | None = None, *, deadline_seconds: float | None = None
    ) -> list[StoredCeiling]:
        """One ceiling (or none), or every ceiling when `name` is None."""
        rows = await self._fetch("get_ceilings", name, deadline_seconds=deadline_seconds)
        return [_stored_ceiling(row) for row in rows]

    async def ceiling_oversubscription(
        self,
        days: int,
        rule: OversubscriptionRule,
        name: str | None = None,
        *,
        deadline_seconds: float | None = None,
    ) -> list[CeilingOversubscription]:
        """Every ceiling's oversubscription over the last `days` days (or the one named;
        none: no such ceiling), judged by `rule`."""
        rows = await self._fetch(
            "ceiling_oversubscription",
            days,
            # numeric in the statement: the rule's ratios as written, not as binary floats
            Decimal(repr(rule.warn_above)),
            Decimal(repr(rule.critical_above)),
            name,
            deadline_seconds=deadline_seconds,
        )
        return [_oversubscription(row) for row in rows]

    async def tenant_utilization(
        self, limit: int, *, deadline_seconds: float | None = None
    ) -> list[tuple[str, float]]:
        """(tenant, share of its token burst in use), the most utilized first, at most `limit`."""
        rows = await self._fetch("tenant_utilization", limit, deadline_seconds=deadline_seconds)
        return [(row["tenant"], float(row["utilization"])) for row in rows]

    async def cool_down_ceilings(
        self,
        model: str,
        seconds: float,
        upstream: str | None = None,
        scoped_only: bool = False,
        *,
        deadline_seconds: float | None = None,
    ) -> list[str]:
        """Empty the ceilings matching `model` that bound deployment `upstream` (scoped
        to it, or unless `scoped_only` to none; None: every one) for `seconds` of
        refill; their names."""
        rows = await self._fetch(
            "cool_down_ceilings",
            model,
            seconds,
            upstream,
            scoped_only,
            deadline_seconds=deadline_seconds,
        )
        return [str(row["ceiling"]) for row in rows]

    async def delete_ceiling(self, name: str, *, deadline_seconds: float | None = None) -> bool:
        """Delete a ceiling; whether it existed."""
        rows = await self._fetch("delete_ceiling", name, deadline_seconds=deadline_seconds)
        return bool(rows)


def _etags(if_match: Sequence[str] | None) -> list[str] | None:
    """The If-Match list as the statements take it (None: no precondition)."""
    return None if if_match is None else list(if_match)


def _queue_steps(ceiling: Ceiling) -> list[int | None] | None:
    """The ladder's queue_ms array (migration 0025); None when no step queues."""
    waits = [step.queue_ms for step in ceiling.shed]
    return waits if any(w is not None for w in waits) else None


def _stored_ceiling(row: Row) -> StoredCeiling:
    above = row["shed_above"] or ()
    waits = row["shed_queue_ms"] or [None] * len(above)
    steps = [
        ShedStep(
            above=above,
            admit=[p for p in PRIORITIES if mask >> priority_rank(p) & 1],
            small_request_tokens=small,
            queue_ms=queue_ms,
        )
        for above, mask, small, queue_ms in zip(
            above, row["shed_admit"] or (), row["shed_small"] or (), waits, strict=True
        )
    ]
    return StoredCeiling(
        name=row["ceiling"],
        ceiling=Ceiling(
            models=list(row["models"]),
            tokens_per_minute=row["tokens_per_minute"],
            token_burst=row["token_burst"],
            requests_per_minute=row["requests_per_minute"],
            request_burst=row["request_burst"],
            max_in_flight=row["max_in_flight"],
            shed=steps,
            alert_at=None if row["alert_at"] is None else [float(t) for t in row["alert_at"]],
            alert_hysteresis=row["alert_hysteresis"],
            alert_quiet_seconds=row["alert_quiet_seconds"],
            upstream=row["upstream"],
        ),
        policy_version=int(row["policy_version"]),
        tokens=row["tokens"],
        requests=row["requests"],
        in_flight=int(row["in_flight"]),
        read_at=row["read_at"],
    )


def _oversubscription(row: Row) -> CeilingOversubscription:
    return CeilingOversubscription(
        ceiling=row["ceiling"],
        period_start=row["period_start"],
        period_end=row["period_end"],
        tenants=int(row["tenants"]),
        tenants_without_token_limit=row["tenants_without_token_limit"],
        tenants_without_request_limit=row["tenants_without_request_limit"],
        tokens_per_minute=row["tokens_per_minute"],
        sum_tenant_tokens_per_minute=row["sum_tenant_tokens_per_minute"],
        ratio=row["ratio"],
        requests_per_minute=row["requests_per_minute"],
        sum_tenant_requests_per_minute=row["sum_tenant_requests_per_minute"],
        requests_ratio=row["requests_ratio"],
        active_minutes=int(row["active_minutes"]),
        active_tenants=ActiveTenants(
            p50=int(row["active_tenants_p50"]),
            p95=int(row["active_tenants_p95"]),
            max=int(row["active_tenants_max"]),
        ),
        effective_tokens_per_minute=row["effective_tokens_per_minute"],
        effective_ratio=row["effective_ratio"],
        effective_requests_per_minute=row["effective_requests_per_minute"],
        effective_requests_ratio=row["effective_requests_ratio"],
        verdict=verdict_of(row["verdict"]),
    )
