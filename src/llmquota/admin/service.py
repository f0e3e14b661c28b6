"""The admin service: policies, keys, status and usage, over the store.

Everything that is not a decision goes through here, so that the adapters
(the REST routes, the CLI) never hold the store: they pass domain records in
and get domain records or typed errors back. The rules that belong to the
administration, not to HTTP (a route policy needs its tenant, a key registers
its tenant, status and usage of a tenant that does not exist are not found,
a usage range is bounded), live here once.

Every store call carries a deadline, so a database that stops answering
costs an admin or tenant call a 503 within that deadline, never a hung
request: `deadline_seconds` (the decision deadline in the app) for the
small statements, `report_deadline_seconds` for usage, which sums ledger
rows and may fairly take as long as a statement may run.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from llmquota.domain.errors import InvalidRequest, NameInUse, UnknownName, UnknownTenant
from llmquota.domain.keys import KeyOwner, key_digest, new_key
from llmquota.domain.plans import Ceiling, Plan, StoredCeiling, StoredPlan
from llmquota.domain.policy import Policy
from llmquota.domain.records import LayerStatus, StoredPolicy, UsageTotals
from llmquota.domain.vocabulary import Scope
from llmquota.store.store import Store

# A usage query spans at most about ten years.
MAX_USAGE_RANGE = timedelta(days=3_660)
# The healthz round trip's deadline when the caller names none.
DEFAULT_DEADLINE_SECONDS = 5.0


class AdminService:
    """Administration of one database, for the REST API and the CLI."""

    def __init__(
        self,
        store: Store,
        *,
        deadline_seconds: float = DEFAULT_DEADLINE_SECONDS,
        report_deadline_seconds: float | None = None,
    ) -> None:
        self._store = store
        self._catalog = store.catalog
        self._deadline_seconds = deadline_seconds
        self._report_deadline_seconds = (
            deadline_seconds if report_deadline_seconds is None else report_deadline_seconds
        )

    @classmethod
    async def connect(cls, dsn: str, *, transaction_pooler: bool = False) -> AdminService:
        """A service over a pool of its own, of one connection (for the CLI)."""
        return cls(
            await Store.connect(dsn, min_size=1, max_size=1, transaction_pooler=transaction_pooler)
        )

    async def close(self) -> None:
        """Close the store; only for a service that `connect` opened."""
        await self._store.close()

    async def ping(self) -> None:
        """One database round trip within the deadline, else StoreUnavailable."""
        await self._store.ping(deadline_seconds=self._deadline_seconds)

    async def put_policy(
        self,
        scope: Scope,
        tenant: str | None,
        route: str | None,
        policy: Policy,
        *,
        fallback_models: Sequence[str] = (),
        shards: int | None = None,
    ) -> int:
        """Create or replace the global or a route's policy; its new policy version.

        A route policy needs its tenant registered; `shards` is the global
        layer's (None: as many as now).
        """
        if scope == "route" and tenant is not None and not await self._tenant_exists(tenant):
            raise UnknownTenant(f"unknown tenant {tenant!r}")
        return await self._store.put_policy(
            scope,
            tenant,
            route,
            policy,
            fallback_models=fallback_models,
            shards=shards,
            deadline_seconds=self._deadline_seconds,
        )

    async def put_tenant_policy(self, tenant: str, plan: str | None, own: dict[str, Any]) -> int:
        """Set the fields a tenant's policy sets itself and its plan; its policy version.

        Registers the tenant. The fields `own` leaves out come from the plan.
        """
        version = await self._catalog.put_tenant_policy(
            tenant, plan, own, deadline_seconds=self._deadline_seconds
        )
        if version is None:
            raise InvalidRequest(f"plan: unknown plan {plan!r}")
        return version

    async def get_policy(self, scope: Scope, tenant: str | None, route: str | None) -> StoredPolicy:
        """A layer's effective policy and version, or UnknownTenant when it has none."""
        found = await self._store.get_policy(
            scope, tenant, route, deadline_seconds=self._deadline_seconds
        )
        if found is None:
            raise UnknownTenant(f"no {scope} policy")
        return found

    async def put_plan(self, name: str, plan: Plan) -> int:
        """Create or replace a plan; how many tenants it changed (all at once)."""
        return await self._catalog.put_plan(name, plan, deadline_seconds=self._deadline_seconds)

    async def plans(self, name: str | None = None) -> list[StoredPlan]:
        """Every plan, or the one named (UnknownName when there is none)."""
        found = await self._catalog.get_plans(name, deadline_seconds=self._deadline_seconds)
        if name is not None and not found:
            raise UnknownName(f"unknown plan {name!r}")
        return found

    async def delete_plan(self, name: str) -> None:
        """Delete a plan; NameInUse while tenants are on it."""
        status = await self._catalog.delete_plan(name, deadline_seconds=self._deadline_seconds)
        if status == "in_use":
            raise NameInUse(f"plan {name!r} has tenants on it; move them first")
        if status == "not_found":
            raise UnknownName(f"unknown plan {name!r}")

    async def put_ceiling(self, name: str, ceiling: Ceiling) -> int:
        """Create or replace a provider ceiling; its policy version."""
        return await self._catalog.put_ceiling(
            name, ceiling, deadline_seconds=self._deadline_seconds
        )

    async def ceilings(self, name: str | None = None) -> list[StoredCeiling]:
        """Every ceiling, or the one named (UnknownName when there is none), refilled to now."""
        found = await self._catalog.get_ceilings(name, deadline_seconds=self._deadline_seconds)
        if name is not None and not found:
            raise UnknownName(f"unknown ceiling {name!r}")
        return found

    async def tenant_utilization(self, limit: int) -> list[tuple[str, float]]:
        """The most utilized tenants' share of their token burst in use, at most `limit`."""
        return await self._catalog.tenant_utilization(
            limit, deadline_seconds=self._deadline_seconds
        )

    async def cool_down_ceilings(self, model: str, seconds: float) -> list[str]:
        """The provider refused `model`: its ceilings admit nothing for `seconds`."""
        return await self._catalog.cool_down_ceilings(
            model, seconds, deadline_seconds=self._deadline_seconds
        )

    async def delete_ceiling(self, name: str) -> None:
        """Delete a provider ceiling (UnknownName when there is none)."""
        if not await self._catalog.delete_ceiling(name, deadline_seconds=self._deadline_seconds):
            raise UnknownName(f"unknown ceiling {name!r}")

    async def create_key(self, tenant: str) -> str:
        """Issue a key for a tenant (registering it if new); the plaintext, shown once."""
        await self._store.ensure_tenant(tenant, deadline_seconds=self._deadline_seconds)
        key = new_key()
        await self._store.insert_api_key(
            key_digest(key), tenant, deadline_seconds=self._deadline_seconds
        )
        return key

    async def ensure_first_admin_key(self) -> str | None:
        """An admin key, when the database has none yet; None when it has one."""
        key = new_key()
        stored = await self._store.insert_first_admin_key(
            key_digest(key), deadline_seconds=self._deadline_seconds
        )
        return key if stored else None

    async def find_key(self, digest: bytes) -> KeyOwner | None:
        """Whose key has this digest; None for a key that was never issued (or was deleted)."""
        found = await self._store.find_api_key(digest, deadline_seconds=self._deadline_seconds)
        return None if found is None else KeyOwner(key_id=found[0], tenant=found[1])

    async def tenant_status(self, tenant: str) -> list[LayerStatus]:
        """Every layer the tenant's requests pass, refilled to now."""
        layers = await self._store.layer_status(tenant, deadline_seconds=self._deadline_seconds)
        if not any(layer.scope == "tenant" for layer in layers):
            raise UnknownTenant(f"unknown tenant {tenant!r}")
        return layers

    async def tenant_usage(self, tenant: str, start: datetime, end: datetime) -> UsageTotals:
        """Ledger totals of a registered tenant over [start, end)."""
        if start > end or end - start > MAX_USAGE_RANGE:
            raise InvalidRequest("'from' must be before 'to', at most 10 years apart")
        if not await self._tenant_exists(tenant):
            raise UnknownTenant(f"unknown tenant {tenant!r}")
        return await self._store.tenant_usage(
            tenant, start, end, deadline_seconds=self._report_deadline_seconds
        )

    async def _tenant_exists(self, tenant: str) -> bool:
        return await self._store.tenant_exists(tenant, deadline_seconds=self._deadline_seconds)
