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
small statements, `report_deadline_seconds` for usage and a ceiling's
oversubscription, which read ledger rows and may fairly take as long as a
statement may run.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime, timedelta
from typing import Any

from llmquota.admin.keys import KeyService
from llmquota.domain.errors import (
    InvalidRequest,
    NameInUse,
    PreconditionFailed,
    TenantBusy,
    UnknownName,
    UnknownTenant,
)
from llmquota.domain.keys import KeyOwner
from llmquota.domain.oversubscription import (
    CeilingOversubscription,
    OversubscriptionRule,
    check_days,
)
from llmquota.domain.plans import Ceiling, Plan, StoredCeiling, StoredPlan
from llmquota.domain.policy import Policy
from llmquota.domain.records import LayerStatus, StoredPolicy, UsageTotals
from llmquota.domain.validation import check_name
from llmquota.domain.vocabulary import Scope
from llmquota.store.store import Store
from llmquota.store.tenants import TenantEntry

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
        policies_written: Callable[[], Awaitable[None]] | None = None,
        admin_key_configured: bool = False,
        oversubscription_rule: OversubscriptionRule | None = None,
    ) -> None:
        self._store = store
        # The key lifecycle and tenant suspension (admin/keys.py).
        self.keys = KeyService(
            store, deadline_seconds=deadline_seconds, admin_elsewhere=admin_key_configured
        )
        # Called after a policy, plan or ceiling write committed and before it
        # answers: the app reloads its own worker's policy cache there, so its
        # next admission already decides by the write (other workers hear of it
        # by NOTIFY, store/listener.py).
        self._policies_written = policies_written
        self._catalog = store.catalog
        self._deadline_seconds = deadline_seconds
        self._report_deadline_seconds = (
            deadline_seconds if report_deadline_seconds is None else report_deadline_seconds
        )
        # The verdict's thresholds (LLMQUOTA_OVERSUBSCRIPTION_*_RATIO).
        self._oversubscription_rule = oversubscription_rule or OversubscriptionRule()

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
        if_match: Sequence[str] | None = None,
    ) -> int:
        """Create or replace the global or a route's policy; its new policy version.

        A route policy needs its tenant registered; `shards` is the global
        layer's (None: as many as now). `if_match` (ETags, or "*"):
        PreconditionFailed unless the layer's ETag is one of them, in the write's statement.
        """
        _check_names(tenant=tenant, route=route)
        if scope == "route" and tenant is not None and not await self._tenant_exists(tenant):
            raise UnknownTenant(f"unknown tenant {tenant!r}")
        version = await self._store.put_policy(
            scope,
            tenant,
            route,
            policy,
            fallback_models=fallback_models,
            shards=shards,
            if_match=if_match,
            deadline_seconds=self._deadline_seconds,
        )
        await self._written()
        return version

    async def put_tenant_policy(
        self,
        tenant: str,
        plan: str | None,
        own: dict[str, Any],
        *,
        if_match: Sequence[str] | None = None,
    ) -> int:
        """Set the fields a tenant's policy sets itself and its plan; its policy version.

        Registers the tenant. The fields `own` leaves out come from the plan.
        `if_match`: as put_policy's.
        """
        _check_names(tenant=tenant, plan=plan)
        version = await self._catalog.put_tenant_policy(
            tenant, plan, own, if_match=if_match, deadline_seconds=self._deadline_seconds
        )
        if version is None:
            raise InvalidRequest(f"plan: unknown plan {plan!r}")
        await self._written()
        return version

    async def get_policy(self, scope: Scope, tenant: str | None, route: str | None) -> StoredPolicy:
        """A layer's effective policy and version, or UnknownTenant when it has none."""
        found = await self._store.get_policy(
            scope, tenant, route, deadline_seconds=self._deadline_seconds
        )
        if found is None:
            raise UnknownTenant(f"no {scope} policy")
        return found

    async def put_plan(
        self, name: str, plan: Plan, *, if_match: Sequence[str] | None = None
    ) -> int:
        """Create or replace a plan; how many tenants it changed (all at once).

        `if_match`: as put_policy's, against the plan's ETag.
        """
        _check_names(plan=name)
        changed = await self._catalog.put_plan(
            name, plan, if_match=if_match, deadline_seconds=self._deadline_seconds
        )
        await self._written()
        return changed

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
        await self._written()

    async def put_ceiling(
        self, name: str, ceiling: Ceiling, *, if_match: Sequence[str] | None = None
    ) -> int:
        """Create or replace a provider ceiling; its policy version.

        `if_match`: as put_policy's, against the ceiling's ETag (its policy version).
        """
        _check_names(ceiling=name)
        version = await self._catalog.put_ceiling(
            name, ceiling, if_match=if_match, deadline_seconds=self._deadline_seconds
        )
        await self._written()
        return version

    async def ceilings(self, name: str | None = None) -> list[StoredCeiling]:
        """Every ceiling, or the one named (UnknownName when there is none), refilled to now."""
        found = await self._catalog.get_ceilings(name, deadline_seconds=self._deadline_seconds)
        if name is not None and not found:
            raise UnknownName(f"unknown ceiling {name!r}")
        return found

    @property
    def oversubscription_rule(self) -> OversubscriptionRule:
        """The thresholds ceiling_oversubscription judges by."""
        return self._oversubscription_rule

    async def ceiling_oversubscription(
        self, name: str | None, days: int
    ) -> list[CeilingOversubscription]:
        """How oversubscribed the ceiling named (UnknownName when there is none), or
        every ceiling (None), is over the last `days` days (1 .. MAX_DAYS)."""
        check_days(days)
        if name is not None:
            _check_names(ceiling=name)
        found = await self._catalog.ceiling_oversubscription(
            days,
            self._oversubscription_rule,
            name,
            deadline_seconds=self._report_deadline_seconds,
        )
        if name is not None and not found:
            raise UnknownName(f"unknown ceiling {name!r}")
        return found

    async def tenant_utilization(self, limit: int) -> list[tuple[str, float]]:
        """The most utilized tenants' share of their token burst in use, at most `limit`."""
        return await self._catalog.tenant_utilization(
            limit, deadline_seconds=self._deadline_seconds
        )

    async def cool_down_ceilings(
        self, model: str, seconds: float, upstream: str | None = None, *, scoped_only: bool = False
    ) -> list[str]:
        """The provider (deployment `upstream`) refused `model`: the ceilings that bound
        it admit nothing for `seconds` (see Catalog.cool_down_ceilings)."""
        return await self._catalog.cool_down_ceilings(
            model, seconds, upstream, scoped_only, deadline_seconds=self._deadline_seconds
        )

    async def delete_ceiling(self, name: str) -> None:
        """Delete a provider ceiling (UnknownName when there is none)."""
        if not await self._catalog.delete_ceiling(name, deadline_seconds=self._deadline_seconds):
            raise UnknownName(f"unknown ceiling {name!r}")
        await self._written()

    async def _written(self) -> None:
        if self._policies_written is not None:
            await self._policies_written()

    async def create_key(self, tenant: str) -> str:
        """Issue a key for a tenant (registering it if new); the plaintext, shown once."""
        _check_names(tenant=tenant)
        return (await self.keys.create(tenant)).key

    async def ensure_first_admin_key(self) -> str | None:
        """An admin key, when the database has none yet; None when it has one."""
        return await self.keys.ensure_first_admin_key()

    async def find_key(self, digest: bytes) -> KeyOwner | None:
        """The usable key with this digest; None for one unknown, revoked, expired or
        rotated out."""
        return await self.keys.find(digest)

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

    async def list_tenants(
        self, after: str | None, limit: int, plan: str | None
    ) -> list[TenantEntry]:
        """At most `limit` tenants by name after `after`, on `plan` when named."""
        return await self._store.tenants.list_tenants(
            after, limit, plan, deadline_seconds=self._deadline_seconds
        )

    async def tenant_own_policy(self, tenant: str) -> tuple[dict[str, Any], str | None, int]:
        """The fields a tenant's policy sets itself, its plan and version (UnknownTenant)."""
        found = await self._store.tenants.own_policy(
            tenant, deadline_seconds=self._deadline_seconds
        )
        if found is None:
            raise UnknownTenant(f"unknown tenant {tenant!r}")
        return found

    async def delete_tenant(self, tenant: str, if_match: Sequence[str] | None = None) -> None:
        """Delete a tenant's layers, keys and policy; the usage ledger keeps its rows.

        UnknownTenant, PreconditionFailed, or NameInUse while it has active reservations.
        """
        _check_names(tenant=tenant)
        done = await self._store.tenants.delete_tenant(
            tenant, if_match, deadline_seconds=self._deadline_seconds
        )
        if done.status == "not_found":
            raise UnknownTenant(f"unknown tenant {tenant!r}")
        if done.status == "precondition_failed":
            raise PreconditionFailed(f"the policy of tenant {tenant!r} changed since that ETag")
        if done.status == "active":
            raise TenantBusy(
                f"tenant {tenant!r} has {done.active_reservations} active reservations; "
                "settle or release them (or let their leases expire) first",
                done.active_reservations,
            )
        await self._written()

    async def _tenant_exists(self, tenant: str) -> bool:
        return await self._store.tenant_exists(tenant, deadline_seconds=self._deadline_seconds)


def _check_names(**names: str | None) -> None:
    """Every name a write stores follows domain.names, whoever calls (the API checks
    its paths and bodies first; the library and the CLI come here directly)."""
    for kind, name in names.items():
        if name is not None:
            check_name(kind, name)
