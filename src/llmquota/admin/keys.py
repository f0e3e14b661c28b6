"""The key lifecycle: issue, list, revoke, rotate; tenant suspension.

The rules that belong to the administration live here once, for the REST
routes and the CLI alike: scopes are a non-empty subset of `admit` and
`read`, an expiry is in the future (by the database's clock: the statement
checks), a grace is 0 to 7 days, a revoked or expired key is not rotated,
and the last admin key that stays usable cannot be revoked unless another
admin key is configured outside the database (LLMQUOTA_ADMIN_KEY).

Revoking or rotating changes the key's row; the database announces it
(migrations 0014 and 0018) and every worker's key cache drops the old digest.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

from llmquota.domain.errors import InvalidRequest, NameInUse, UnknownName, UnknownTenant
from llmquota.domain.key_limits import NO_LIMITS, KeyLimits
from llmquota.domain.keys import (
    SCOPES,
    IssuedKey,
    KeyOwner,
    KeyRecord,
    check_grace_seconds,
    check_label,
    check_scopes,
    key_digest,
    new_key,
    shown_prefix,
)
from llmquota.domain.validation import check_name
from llmquota.store.store import Store


class KeyService:
    """API keys of tenants and admins, and tenant suspension, over the store."""

    def __init__(self, store: Store, *, deadline_seconds: float, admin_elsewhere: bool) -> None:
        self._store = store
        self._keys = store.keys
        self._deadline_seconds = deadline_seconds
        # An admin key configured outside the database (LLMQUOTA_ADMIN_KEY):
        # then every stored admin key may be revoked.
        self._admin_elsewhere = admin_elsewhere

    async def create(
        self,
        tenant: str | None,
        *,
        label: str | None = None,
        expires_at: datetime | None = None,
        scopes: Sequence[str] = SCOPES,
        limits: KeyLimits = NO_LIMITS,
    ) -> IssuedKey:
        """Issue a key for `tenant` (registering it if new; None: an admin key), with
        its own limits (a tenant key's only: an admin key is never limited)."""
        if tenant is None and not limits.is_empty:
            raise InvalidRequest("an admin key has no limits of its own")
        label = check_label(label)
        chosen = check_scopes(scopes)
        if expires_at is not None and expires_at.tzinfo is None:
            expires_at = expires_at.replace(tzinfo=UTC)
        if tenant is not None:
            check_name("tenant", tenant)
        key = new_key()  # its statement registers a new tenant too
        record = await self._keys.insert(
            key_digest(key),
            tenant,
            shown_prefix(key),
            label=label,
            scopes=chosen,
            expires_at=expires_at,
            limits=limits,
            deadline_seconds=self._deadline_seconds,
        )
        if record is None:
            raise InvalidRequest("'expires_at' must be in the future")
        return IssuedKey(key=key, record=record)

    async def ensure_first_admin_key(self) -> str | None:
        """An admin key, when the database has none yet; None when it has one."""
        key = new_key()
        stored = await self._keys.insert_first_admin_key(
            key_digest(key), shown_prefix(key), deadline_seconds=self._deadline_seconds
        )
        return key if stored else None

    async def find(self, digest: bytes) -> KeyOwner | None:
        """The usable key with this digest; None for a key unknown, revoked, expired or
        rotated out."""
        return await self._keys.find(digest, deadline_seconds=self._deadline_seconds)

    async def list(self, tenant: str | None) -> list[KeyRecord]:
        """A tenant's keys (None: the admin keys); UnknownTenant for a tenant never seen."""
        if tenant is not None and not await self._store.tenant_exists(
            tenant, deadline_seconds=self._deadline_seconds
        ):
            raise UnknownTenant(f"unknown tenant {tenant!r}")
        return await self._keys.list_keys(tenant, deadline_seconds=self._deadline_seconds)

    async def set_limits(self, tenant: str, key_id: int, limits: KeyLimits) -> None:
        """Replace a tenant key's own limits (decided from its next admission on);
        UnknownName when the tenant has no such key, or it is revoked."""
        if not await self._keys.put_limits(
            key_id, tenant, limits, deadline_seconds=self._deadline_seconds
        ):
            raise UnknownName(f"unknown key {key_id} (or revoked)")

    async def revoke(self, tenant: str | None, key_id: int) -> None:
        """Revoke a key (again: nothing changes); UnknownName when the tenant (None:
        the admins) has no such key, NameInUse for the last usable admin key."""
        outcome = await self._keys.revoke(
            key_id,
            tenant,
            self._admin_elsewhere,
            deadline_seconds=self._deadline_seconds,
        )
        if outcome == "unknown":
            raise UnknownName(f"unknown key {key_id}")
        if outcome == "last_admin_key":
            raise NameInUse(
                f"key {key_id} is the last admin key that stays usable: create another "
                "admin key first (or set LLMQUOTA_ADMIN_KEY)"
            )

    async def rotate(self, tenant: str | None, key_id: int, grace_seconds: int = 0) -> IssuedKey:
        """A new secret for the key; the old one works `grace_seconds` more."""
        grace = check_grace_seconds(grace_seconds)
        key = new_key()
        rotated = await self._keys.rotate(
            key_id,
            tenant,
            key_digest(key),
            shown_prefix(key),
            grace,
            deadline_seconds=self._deadline_seconds,
        )
        if rotated is None:
            raise UnknownName(f"unknown key {key_id}")
        if rotated is False:
            raise NameInUse(f"key {key_id} is revoked or expired: issue a new key instead")
        assert isinstance(rotated, KeyRecord)
        return IssuedKey(key=key, record=rotated)

    async def suspend(self, tenant: str, suspended: bool) -> datetime | None:
        """Suspend (or resume) a tenant: the suspension's time, None once resumed."""
        check_name("tenant", tenant)
        moment = await self._keys.suspend(
            tenant, suspended, deadline_seconds=self._deadline_seconds
        )
        if moment is False:
            raise UnknownTenant(f"unknown tenant {tenant!r}")
        assert moment is None or isinstance(moment, datetime)
        return moment

    async def note_use(self, key_id: int) -> None:
        await self._keys.note_use(key_id, deadline_seconds=self._deadline_seconds)
