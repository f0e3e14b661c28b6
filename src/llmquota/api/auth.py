"""Authentication: bearer tokens to callers, digests compared in constant time.

Keys are made and digested in llmquota.domain.keys; whose a key is, the
admin service answers (the lookup passed in). Lookups are cached per worker
for a short time, so authentication does not add a round trip to every admit.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from llmquota.domain.keys import KeyOwner, key_digest

# Whose key has a digest: AdminService.find_key in the app.
KeyLookup = Callable[[bytes], Awaitable[KeyOwner | None]]

KEY_CACHE_SECONDS = 30.0
KEY_CACHE_MAX_ENTRIES = 10_000


class AuthenticationFailed(Exception):
    """Missing or wrong key; the response never says which."""


class Forbidden(Exception):
    """A valid key acting outside its tenant."""


@dataclass(frozen=True, slots=True)
class Caller:
    """Who is calling: an admin (any tenant) or one tenant."""

    tenant: str | None

    @property
    def is_admin(self) -> bool:
        return self.tenant is None

    def require_admin(self) -> None:
        if not self.is_admin:
            raise Forbidden("this endpoint needs the admin key")

    def require_tenant(self, tenant: str) -> None:
        if not self.is_admin and self.tenant != tenant:
            raise Forbidden("this key may only act on its own tenant")

    @property
    def scope(self) -> str | None:
        """The tenant to scope reservation lookups to; None for an admin."""
        return self.tenant


def bearer_token(authorization: str | None) -> str:
    """The token of an `Authorization: Bearer ...` header."""
    if not authorization:
        raise AuthenticationFailed
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthenticationFailed
    return token.strip()


class Authenticator:
    """Resolves bearer tokens to callers, with a small per-worker cache."""

    def __init__(self, lookup: KeyLookup, admin_key: str | None) -> None:
        self._lookup = lookup
        self._admin_digest = key_digest(admin_key) if admin_key else None
        self._cache: dict[bytes, tuple[float, Caller]] = {}

    def cached_tenant(self, authorization: str | None) -> str | None:
        """The tenant of a key this worker has seen lately; None for admins and unknowns.

        No database round trip: used to put a request in its tenant's queue
        before anything else is done with it.
        """
        try:
            digest = key_digest(bearer_token(authorization))
        except AuthenticationFailed:
            return None
        cached = self._cache.get(digest)
        if cached is None or cached[0] <= time.monotonic():
            return None
        return cached[1].tenant

    async def caller(self, authorization: str | None) -> Caller:
        """The caller for a header, or AuthenticationFailed."""
        digest = key_digest(bearer_token(authorization))
        if self._admin_digest is not None and hmac.compare_digest(digest, self._admin_digest):
            return Caller(tenant=None)
        cached = self._cache.get(digest)
        now = time.monotonic()
        if cached is not None and cached[0] > now:
            return cached[1]
        found = await self._lookup(digest)
        if found is None:
            raise AuthenticationFailed
        caller = Caller(tenant=found.tenant)
        if len(self._cache) >= KEY_CACHE_MAX_ENTRIES:
            self._cache.clear()
        self._cache[digest] = (now + KEY_CACHE_SECONDS, caller)
        return caller
