"""Typed access to API keys and tenant suspension: one named statement per call.

Beside store.py, over the same pool (the statements are in sql/queries.sql,
the revocation's function in sql/keys.sql). Every time a statement compares
(an expiry in the future, a grace running out) is the database's clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from llmquota.domain.key_limits import NO_LIMITS, KeyLimits
from llmquota.domain.keys import KeyOwner, KeyRecord
from llmquota.store.connection import Row
from llmquota.store.pool import DeadlinePool


class KeyStore:
    """API keys: issue, find, list, revoke, rotate, note uses; tenant suspension."""

    def __init__(self, pool: DeadlinePool, sql: dict[str, str]) -> None:
        self._pool = pool
        self._sql = sql

    async def _fetch(self, name: str, *args: Any, deadline_seconds: float | None) -> list[Row]:
        return await self._pool.fetch(self._sql[name], args, deadline_seconds=deadline_seconds)

    async def insert(
        self,
        key_hash: bytes,
        tenant: str | None,
        prefix: str,
        *,
        label: str | None,
        scopes: Sequence[str],
        expires_at: datetime | None,
        limits: KeyLimits = NO_LIMITS,
        deadline_seconds: float | None = None,
    ) -> KeyRecord | None:
        """Store a key (with its own limits, in the same statement); None when
        `expires_at` is not in the future by the database's clock."""
        rows = await self._fetch(
            "insert_api_key",
            key_hash,
            tenant,
            prefix,
            label,
            list(scopes),
            expires_at,
            *_limit_arguments(limits),
            not limits.is_empty,
            deadline_seconds=deadline_seconds,
        )
        return _record(rows[0]) if rows else None

    async def insert_first_admin_key(
        self, key_hash: bytes, prefix: str, *, deadline_seconds: float | None = None
    ) -> bool:
        """Store an admin key digest unless one exists; True if stored."""
        rows = await self._fetch(
            "insert_first_admin_key", key_hash, prefix, deadline_seconds=deadline_seconds
        )
        return bool(rows)

    async def find(
        self, key_hash: bytes, *, deadline_seconds: float | None = None
    ) -> KeyOwner | None:
        """The usable key with this digest, or None (unknown, revoked, expired, rotated out)."""
        rows = await self._fetch("find_api_key", key_hash, deadline_seconds=deadline_seconds)
        if not rows:
            return None
        row = rows[0]
        valid = row["valid_seconds"]
        models = row["models"]
        return KeyOwner(
            key_id=int(row["key_id"]),
            tenant=row["tenant"],
            scopes=frozenset(row["scopes"]),
            suspended=bool(row["suspended"]),
            valid_seconds=None if valid is None else float(valid),
            models=None if models is None else tuple(models),
        )

    async def list_keys(
        self, tenant: str | None, *, deadline_seconds: float | None = None
    ) -> list[KeyRecord]:
        """A tenant's keys (None: the admin keys), revoked ones too, oldest first."""
        rows = await self._fetch(
            "list_api_keys", tenant, tenant is None, deadline_seconds=deadline_seconds
        )
        return [_record(row) for row in rows]

    async def revoke(
        self,
        key_id: int,
        tenant: str | None,
        admin_elsewhere: bool,
        *,
        deadline_seconds: float | None = None,
    ) -> str:
        """'revoked', 'unknown' or 'last_admin_key' (see lq_revoke_key)."""
        rows = await self._fetch(
            "revoke_api_key", key_id, tenant, admin_elsewhere, deadline_seconds=deadline_seconds
        )
        return str(rows[0]["outcome"])

    async def rotate(
        self,
        key_id: int,
        tenant: str | None,
        key_hash: bytes,
        prefix: str,
        grace_seconds: int,
        *,
        deadline_seconds: float | None = None,
    ) -> KeyRecord | bool | None:
        """The rotated key's record; False: it is revoked or expired; None: no such key."""
        rows = await self._fetch(
            "rotate_api_key",
            key_id,
            tenant,
            tenant is None,
            key_hash,
            prefix,
            grace_seconds,
            deadline_seconds=deadline_seconds,
        )
        if not rows:
            return None
        if not rows[0]["rotated"]:
            return False
        return _record(rows[0])

    async def put_limits(
        self,
        key_id: int,
        tenant: str,
        limits: KeyLimits,
        *,
        deadline_seconds: float | None = None,
    ) -> bool:
        """Replace a tenant key's own limits; False: no such usable key of that tenant."""
        rows = await self._fetch(
            "put_key_limits",
            key_id,
            tenant,
            *_limit_arguments(limits),
            deadline_seconds=deadline_seconds,
        )
        return bool(rows)

    async def note_use(self, key_id: int, *, deadline_seconds: float | None = None) -> None:
        """Remember that a key was used now."""
        await self._fetch("note_key_use", key_id, deadline_seconds=deadline_seconds)

    async def suspend(
        self, tenant: str, suspended: bool, *, deadline_seconds: float | None = None
    ) -> datetime | bool | None:
        """Suspend or resume: the suspension's time (None once resumed); False: no such tenant."""
        rows = await self._fetch(
            "suspend_tenant", tenant, suspended, deadline_seconds=deadline_seconds
        )
        if not rows:
            return False
        moment: datetime | None = rows[0]["suspended_at"]
        return moment


def _limit_arguments(limits: KeyLimits) -> tuple[Any, ...]:
    """The limits as the statements take them: rates and bursts, permits, models
    as written and as LIKE patterns."""
    return (
        limits.tokens_per_minute,
        limits.effective_token_burst,
        limits.requests_per_minute,
        limits.effective_request_burst,
        limits.max_in_flight,
        limits.models,
        limits.like_patterns,
    )


def _limits(row: Row) -> KeyLimits:
    """A key's limits from a row of its layer's columns (all NULL: none)."""
    models = row["models"]
    return KeyLimits(
        tokens_per_minute=row["tokens_per_minute"],
        token_burst=row["token_burst"],
        requests_per_minute=row["requests_per_minute"],
        request_burst=row["request_burst"],
        max_in_flight=row["max_in_flight"],
        models=None if models is None else list(models),
    )


def _record(row: Row) -> KeyRecord:
    return KeyRecord(
        key_id=int(row["key_id"]),
        tenant=row["tenant"],
        prefix=row["prefix"],
        label=row["label"],
        scopes=tuple(row["scopes"]),
        created_at=row["created_at"],
        last_used_at=row["last_used_at"],
        expires_at=row["expires_at"],
        revoked_at=row["revoked_at"],
        limits=_limits(row),
    )
