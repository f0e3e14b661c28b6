"""API keys: bearer tokens, stored as SHA-256 digests, compared in constant time.

A key is 32 random bytes, so a plain digest is enough (no password hashing
needed: there is nothing to brute-force). Lookups are cached per worker for
a short time, so authentication does not add a round trip to every admit.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass

from llmquota.store.store import Store

KEY_PREFIX = "lq_"
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


def new_key() -> str:
    """A fresh random API key."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def key_digest(key: str) -> bytes:
    """The stored form of a key."""
    return hashlib.sha256(key.encode()).digest()


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

    def __init__(self, store: Store, admin_key: str | None) -> None:
        self._store = store
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
        found = await self._store.find_api_key(digest)
        if found is None:
            raise AuthenticationFailed
        caller = Caller(tenant=found[1])
        if len(self._cache) >= KEY_CACHE_MAX_ENTRIES:
            self._cache.clear()
        self._cache[digest] = (now + KEY_CACHE_SECONDS, caller)
        return caller
