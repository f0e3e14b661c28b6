"""Typed access to the console's statements (sql/console_queries.sql).

Beside store.py, over the same pool: the decision counts every worker adds
to, the reads of the console's overview the admin API has no statement for,
and the console's sessions. One named statement per method.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from llmquota.domain.decision_counts import CountKey, MinuteCount, TenantDay, minute_datetime
from llmquota.store.connection import Row
from llmquota.store.pool import DeadlinePool
from llmquota.store.sqlfiles import named_queries


class ConsoleStore:
    """Decision counts, today's top tenants and console sessions, one statement per call."""

    def __init__(self, pool: DeadlinePool, *, deadline_seconds: float | None = None) -> None:
        self._pool = pool
        self._sql = named_queries("console_queries.sql")
        self._deadline_seconds = deadline_seconds

    async def _fetch(self, name: str, *args: Any) -> list[Row]:
        return await self._pool.fetch(
            self._sql[name], args, deadline_seconds=self._deadline_seconds
        )

    async def add_decision_counts(
        self, counts: list[tuple[CountKey, int]], keep_seconds: float
    ) -> None:
        """Add counts (each key once, sorted) and prune minutes older than `keep_seconds`."""
        await self._fetch(
            "add_decision_counts",
            [minute_datetime(key[0]) for key, _ in counts],
            [key[1] for key, _ in counts],
            [key[2] for key, _ in counts],
            [key[3] for key, _ in counts],
            [decisions for _, decisions in counts],
            keep_seconds,
        )

    async def decisions_per_minute(self, since: datetime) -> list[MinuteCount]:
        """Every worker's decisions per minute, outcome and reason since `since`."""
        rows = await self._fetch("decisions_per_minute", since)
        return [
            MinuteCount(r["minute"], r["outcome"], r["reason"], int(r["decisions"])) for r in rows
        ]

    async def tenant_refusals(self, tenant: str, since: datetime, limit: int) -> list[MinuteCount]:
        """A tenant's refusals per minute and reason since `since`, the latest first."""
        rows = await self._fetch("tenant_refusals", tenant, since, limit)
        return [MinuteCount(r["minute"], "refused", r["reason"], int(r["decisions"])) for r in rows]

    async def top_tenants_today(self, limit: int) -> list[TenantDay]:
        """The `limit` tenants with the most tokens today (UTC), with their cost."""
        rows = await self._fetch("top_tenants_today", limit)
        return [
            TenantDay(
                tenant=r["tenant"],
                requests=int(r["requests"]),
                total_tokens=int(r["total_tokens"] or 0),
                cost_usd=r["cost_usd"],
                unpriced_tokens=int(r["unpriced_tokens"]),
            )
            for r in rows
        ]

    async def open_session(
        self, token_digest: bytes, csrf_token: str, key_id: int | None, seconds: float
    ) -> None:
        """Store a new session (and drop the expired ones)."""
        await self._fetch("open_session", token_digest, csrf_token, key_id, seconds)

    async def find_session(self, token_digest: bytes) -> str | None:
        """The CSRF token of the live session with this digest; None: no such session."""
        rows = await self._fetch("find_session", token_digest)
        return str(rows[0]["csrf_token"]) if rows else None

    async def close_session(self, token_digest: bytes) -> None:
        """End a session (nothing when there is none)."""
        await self._fetch("close_session", token_digest)
