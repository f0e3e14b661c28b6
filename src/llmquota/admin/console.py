"""The console's reads and sessions, for the web console (api/console/).

What the admin service and the alert service already answer (tenant status,
ceilings, quotas, credits, keys, alerts, webhooks) the console reads from
them; this adds only what they do not: decisions per minute (flushed by
every worker, admin/decision_flush.py), a tenant's recent refusals, today's
top tenants, and the console's sessions.

A session is an opaque random token in the browser's cookie; the database
holds its SHA-256 digest, the CSRF token of its forms and the admin key that
opened it, so a stolen database row cannot be replayed as a cookie, every
worker knows every session, and revoking that key ends it.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta

from llmquota.domain.decision_counts import SECONDS_PER_MINUTE, MinuteCount, TenantDay
from llmquota.domain.records import LayerStatus
from llmquota.store.console import ConsoleStore
from llmquota.store.store import Store

# Random bytes in a session token and a CSRF token (256 bits each).
TOKEN_BYTES = 32
# Rows of a tenant's recent refusals the console shows at most.
MAX_REFUSAL_ROWS = 200
# A name no tenant can have (tenant names have no spaces): the layer status of
# it is the global layer alone.
NO_TENANT = " no tenant"


def token_digest(token: str) -> bytes:
    """What the database stores of a session token."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


@dataclass(frozen=True, slots=True)
class ConsoleSession:
    """A session just opened: the cookie's token and its forms' CSRF token."""

    token: str
    csrf_token: str


class ConsoleService:
    """Reads and sessions of the console over one store, each with a deadline."""

    def __init__(self, store: Store, *, deadline_seconds: float, session_seconds: int) -> None:
        self._store = store
        self._deadline_seconds = deadline_seconds
        self._console = ConsoleStore(store.pool, deadline_seconds=deadline_seconds)
        self._session_seconds = session_seconds

    @property
    def store(self) -> ConsoleStore:
        """The statements the decision-count flush runs (the same pool)."""
        return self._console

    async def open_session(self, key_id: int | None) -> ConsoleSession:
        """A new session for an admin key that just authenticated (None: the configured one)."""
        session = ConsoleSession(
            secrets.token_urlsafe(TOKEN_BYTES), secrets.token_urlsafe(TOKEN_BYTES)
        )
        await self._console.open_session(
            token_digest(session.token), session.csrf_token, key_id, self._session_seconds
        )
        return session

    async def session_csrf(self, token: str) -> str | None:
        """The CSRF token of a live session; None when the token opens none."""
        return await self._console.find_session(token_digest(token))

    async def close_session(self, token: str) -> None:
        await self._console.close_session(token_digest(token))

    async def decisions_per_minute(self, since: datetime) -> list[MinuteCount]:
        return await self._console.decisions_per_minute(since)

    async def tenant_refusals(self, tenant: str, minutes: int, now: datetime) -> list[MinuteCount]:
        """A tenant's refusals per minute and reason over the last `minutes`, latest first."""
        since = now - timedelta(seconds=minutes * SECONDS_PER_MINUTE)
        return await self._console.tenant_refusals(tenant, since, MAX_REFUSAL_ROWS)

    async def top_tenants_today(self, limit: int) -> list[TenantDay]:
        return await self._console.top_tenants_today(limit)

    async def global_layer(self) -> LayerStatus | None:
        """The global layer (its shards summed), refilled to now; None without a global policy."""
        layers = await self._store.layer_status(NO_TENANT, deadline_seconds=self._deadline_seconds)
        return next((layer for layer in layers if layer.scope == "global"), None)
