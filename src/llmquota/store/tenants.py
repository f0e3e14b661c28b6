"""The tenant directory: a page of tenants, a tenant's own policy, deleting a tenant.

The same thin connector as the Catalog: one named statement of
sql/queries.sql per method, one round trip, typed records back. Deleting is
lq_delete_tenant (sql/plans.sql), one statement that checks the active
reservations and removes the tenant's rows atomically.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from llmquota.store.connection import Row
from llmquota.store.pool import DeadlinePool

# What a tenant's requests meet: admitted as usual, or 403 tenant_suspended.
TenantStatus = Literal["active", "suspended"]


@dataclass(frozen=True, slots=True)
class TenantEntry:
    """One tenant of GET /v1/tenants."""

    tenant: str
    plan: str | None
    status: TenantStatus
    last_activity_at: datetime | None


@dataclass(frozen=True, slots=True)
class TenantDeletion:
    """What deleting a tenant did: 'deleted', 'not_found', 'active' or 'precondition_failed'."""

    status: str
    active_reservations: int


class TenantDirectory:
    """Typed access to the tenant listing and deletion statements."""

    def __init__(self, pool: DeadlinePool, sql: dict[str, str]) -> None:
        self._pool = pool
        self._sql = sql

    async def _fetch(self, name: str, *args: Any, deadline_seconds: float | None) -> list[Row]:
        return await self._pool.fetch(self._sql[name], args, deadline_seconds=deadline_seconds)

    async def list_tenants(
        self,
        after: str | None,
        limit: int,
        plan: str | None,
        *,
        deadline_seconds: float | None = None,
    ) -> list[TenantEntry]:
        """At most `limit` tenants by name, after `after` (None: from the first)."""
        rows = await self._fetch(
            "list_tenants", after, limit, plan, deadline_seconds=deadline_seconds
        )
        return [
            TenantEntry(
                tenant=row["tenant"],
                plan=row["plan"],
                status="suspended" if row["status"] == "suspended" else "active",
                last_activity_at=row["last_activity_at"],
            )
            for row in rows
        ]

    async def own_policy(
        self, tenant: str, *, deadline_seconds: float | None = None
    ) -> tuple[dict[str, Any], str | None, int] | None:
        """The fields a tenant's policy sets itself, its plan and policy version; None if none."""
        rows = await self._fetch(
            "get_policy", "tenant", tenant, None, deadline_seconds=deadline_seconds
        )
        if not rows:
            return None
        row = rows[0]
        own = json.loads(row["own_policy"]) if row["own_policy"] else {}
        return own, row["plan"], int(row["policy_version"])

    async def suspended(self, *, deadline_seconds: float | None = None) -> frozenset[str]:
        """Every suspended tenant."""
        rows = await self._fetch("suspended_tenants", deadline_seconds=deadline_seconds)
        return frozenset(row["tenant"] for row in rows)

    async def delete_tenant(
        self,
        tenant: str,
        if_match: Sequence[str] | None,
        *,
        deadline_seconds: float | None = None,
    ) -> TenantDeletion:
        """Delete a tenant unless it has active reservations (one statement)."""
        rows = await self._fetch(
            "delete_tenant",
            tenant,
            None if if_match is None else list(if_match),
            deadline_seconds=deadline_seconds,
        )
        return TenantDeletion(status=rows[0]["status"], active_reservations=int(rows[0]["active"]))
