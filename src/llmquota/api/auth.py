"""Authentication: bearer tokens to callers, without the database on the hot path.

Keys are made and digested in llmquota.domain.keys; whose a key is, the
admin service answers (the lookup passed in, bounded by its deadline). What
a worker learns is remembered (keycache.py): known keys serve from memory,
are refreshed in the background while in use, and keep working through an
outage for the policy cache's stale window, so that the failure modes hold
for authenticated requests too; unknown digests are answered 401 from
memory for a few seconds. Failed authentications are budgeted per client
address (failures.py), so a flood of wrong keys is refused with 429 before
any database work.

`triage` runs in the fair-share middleware before anything is read, with no
I/O, for the endpoints that take an API key: it puts a request in its
tenant's lane, in the one lane of keys the worker does not know yet (each of
which needs a lookup), or refuses it (no key, a key known to be wrong, a
client out of its budget).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette.types import Scope

from llmquota.api.failures import FailureBudget
from llmquota.api.keycache import KeyCache
from llmquota.api.keyuses import KeyUse, UseNotes
from llmquota.config import Settings
from llmquota.domain.errors import StoreUnavailable, TenantSuspended
from llmquota.domain.key_limits import ModelAllowList
from llmquota.domain.keys import SCOPES, KeyOwner, key_digest
from llmquota.domain.records import AdmitRequest
from llmquota.metrics import Metrics

log = logging.getLogger(__name__)

# Whose key has a digest: AdminService.find_key in the app.
KeyLookup = Callable[[bytes], Awaitable[KeyOwner | None]]

# The fair-share lane of requests whose key this worker does not know yet; no
# tenant can have this name (tenant names match NAME_PATTERN, without spaces).
UNKNOWN_KEYS_LANE = " unknown keys"
# Scope key of a callable the fair share gives the first request with a key this
# worker does not know: `caller` calls it once the key's lookup is over, so that
# the key's other requests, waiting for it, go on (api/fairness.py).
KEY_LOOKED_UP = "llmquota.fair_share.key_looked_up"


class AuthenticationFailed(Exception):
    """Missing or wrong key; the response never says which."""


class Forbidden(Exception):
    """A valid key acting outside its tenant."""


class TooManyFailedAuthentications(Exception):
    """This client address failed to authenticate too often lately; retry later."""

    def __init__(self, retry_after_ms: int) -> None:
        super().__init__(
            "too many requests with missing or invalid API keys from this address; "
            f"retry in {retry_after_ms / 1000:.3f}s"
        )
        self.retry_after_ms = retry_after_ms


@dataclass(frozen=True, slots=True)
class Caller:
    """Who is calling: an admin (any tenant) or one tenant."""

    tenant: str | None
    # What the key may do (an admin may do everything), and whether its tenant
    # is suspended: both read with the key, so checking them costs no statement.
    scopes: frozenset[str] = frozenset(SCOPES)
    suspended: bool = False
    key_id: int | None = None
    # The models the key may name (None: any).
    models: ModelAllowList | None = None

    @property
    def is_admin(self) -> bool:
        return self.tenant is None

    def admitting(self, request: AdmitRequest) -> AdmitRequest:
        """The request as this key asks it: Forbidden (403) naming a model (the
        requested one or an explicit fallback) the key may not use; else naming the
        key, whose own limits and quotas (if any) are decided with the others."""
        if self.models is not None:
            refused = self.models.first_refused(
                [request.model, *(candidate.model for candidate in request.fallbacks)]
            )
            if refused is not None:
                raise Forbidden(
                    f"this key may not use model {refused!r}; it may use {list(self.models.globs)}"
                )
        if self.is_admin or self.key_id is None:
            return request
        return request._replace(key_id=self.key_id)

    def require_scope(self, scope: str) -> None:
        if not self.is_admin and scope not in self.scopes:
            raise Forbidden(f"this key lacks the '{scope}' scope")

    def require_admission(self) -> None:
        """New work: the `admit` scope and a tenant that is not suspended."""
        self.require_scope("admit")
        if self.suspended:
            raise TenantSuspended(f"tenant {self.tenant!r} is suspended")

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


@dataclass(frozen=True, slots=True)
class Triage:
    """Where a request waits before it is served, or why it is refused at once.

    `lane` None: not gated (admin keys, endpoints that take no API key).
    `key`: the digest of a key this worker does not know, which its first
    request looks up (the fair share holds the others with it behind that one).
    """

    lane: str | None = None
    refusal: AuthenticationFailed | TooManyFailedAuthentications | None = None
    key: bytes | None = None


def _caller_of(owner: KeyOwner) -> Caller:
    return Caller(
        tenant=owner.tenant,
        scopes=owner.scopes,
        suspended=owner.suspended,
        key_id=owner.key_id,
        models=ModelAllowList.of(owner.models),
    )


def bearer_token(authorization: str | None) -> str:
    """The token of an `Authorization: Bearer ...` header."""
    if not authorization:
        raise AuthenticationFailed
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthenticationFailed
    return token.strip()


def _digest(authorization: str | None) -> bytes | None:
    """The digest of the header's key; None when there is no well-formed one."""
    try:
        return key_digest(bearer_token(authorization))
    except AuthenticationFailed:
        return None


class Authenticator:
    """Resolves bearer tokens to callers, remembering what it learns per worker."""

    def __init__(
        self,
        lookup: KeyLookup,
        admin_key: str | None,
        settings: Settings,
        metrics: Metrics | None = None,
        note_use: KeyUse | None = None,
    ) -> None:
        self._lookup = lookup
        self._uses = UseNotes(note_use)
        self._admin_digest = key_digest(admin_key) if admin_key else None
        self._keys = KeyCache(
            settings.key_cache_refresh_seconds,
            settings.policy_cache_max_stale_seconds,
            settings.key_negative_cache_seconds,
        )
        self._failures = FailureBudget(
            settings.auth_failures_per_second, settings.auth_failure_burst
        )
        self._metrics = metrics or Metrics()
        # One lookup per digest at a time, however many requests carry it.
        # Each with the key cache's generation when it started (KeyCache.confirm).
        self._first_lookups: dict[bytes, asyncio.Task[tuple[KeyOwner | None, int]]] = {}
        self._refreshes: set[asyncio.Task[None]] = set()

    def triage(self, authorization: str | None, client: str) -> Triage:
        """The lane of a request to an endpoint that takes an API key, or its
        refusal, from memory alone."""
        now = time.monotonic()
        digest = _digest(authorization)
        if digest is not None:
            if self._is_admin(digest):
                return Triage()
            owner = self._keys.known(digest, now)
            if owner is not None:
                return Triage(lane=owner.tenant)
        refusal = self._refusal_from_memory(digest, client, now)
        if refusal is not None:
            return Triage(refusal=refusal)
        # A key known here until its row changed is looked up again in its tenant's lane.
        assert digest is not None  # a missing key is refused from memory
        former = self._keys.former_tenant(digest)
        return Triage(lane=former or UNKNOWN_KEYS_LANE, key=digest)

    async def caller(
        self, authorization: str | None, client: str, scope: Scope | None = None
    ) -> Caller:
        """The caller for a header, or AuthenticationFailed (401),
        TooManyFailedAuthentications (429) or StoreUnavailable (503); then the
        request's KEY_LOOKED_UP, if its `scope` has one."""
        try:
            return await self._caller(authorization, client)
        finally:
            looked_up = scope.get(KEY_LOOKED_UP) if scope is not None else None
            if looked_up is not None:
                looked_up()

    async def _caller(self, authorization: str | None, client: str) -> Caller:
        now = time.monotonic()
        digest = _digest(authorization)
        if digest is not None:
            if self._is_admin(digest):
                return Caller(tenant=None)
            owner = self._keys.known(digest, now)
            if owner is not None:
                if self._keys.claim_refresh(digest, now):
                    self._start_refresh(digest)
                self._uses.used(owner.key_id, now)
                return _caller_of(owner)
        refusal = self._refusal_from_memory(digest, client, now)
        if refusal is not None:
            raise refusal
        assert digest is not None  # a missing key is refused from memory
        # The lookup may fail, so it is paid for first and paid back if the key
        # exists; a lookup the store does not answer stays paid, so that a flood
        # of new keys during an outage cannot keep the pool waiting on the deadline.
        # A request joining a lookup of its key already under way costs none.
        pays = digest not in self._first_lookups
        if pays:
            retry_after_ms = self._failures.spend(client, now)
            if retry_after_ms is not None:
                self._metrics.count_auth_refusal("throttled")
                raise TooManyFailedAuthentications(retry_after_ms)
        owner, since = await self._first_lookup(digest)
        now = time.monotonic()
        if owner is None:
            self._keys.refuse(digest, now, since)
            self._metrics.count_auth_refusal("unknown_key")
            raise AuthenticationFailed
        if pays:
            self._failures.refund(client, now)
        self._keys.confirm(digest, owner, now, since)
        self._uses.used(owner.key_id, now)
        return _caller_of(owner)

    def key_changed(self, digest: bytes | None) -> None:
        """A key's row changed (announced by the database): forget what this worker
        remembers of it, so its next use is looked up. None: any key may have
        changed (the announcements were interrupted), so every known key is
        looked up again at its next use, serving meanwhile, and no refusal stands."""
        if digest is None:
            self._keys.refresh_all()
        else:
            self._keys.drop(digest)

    def tenant_changed(self, tenant: str) -> None:
        """A tenant was suspended or resumed (announced, or done on this worker):
        forget its keys."""
        self._keys.drop_tenant(tenant)

    def key_id_changed(self, key_id: int) -> None:
        """This worker revoked or rotated the key: forget it now, before the
        announcement comes back, so that its next request is refused at once."""
        self._keys.drop_key_id(key_id)

    async def close(self) -> None:
        """Stop the lookups still running."""
        tasks = [*self._refreshes, *self._first_lookups.values(), *self._uses.tasks]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    def _is_admin(self, digest: bytes) -> bool:
        return self._admin_digest is not None and hmac.compare_digest(digest, self._admin_digest)

    def _refusal_from_memory(
        self, digest: bytes | None, client: str, now: float
    ) -> AuthenticationFailed | TooManyFailedAuthentications | None:
        """The refusal of a key the worker cannot vouch for, if memory alone decides it."""
        retry_after_ms = self._failures.retry_after_ms(client, now)
        if retry_after_ms is not None:
            self._metrics.count_auth_refusal("throttled")
            return TooManyFailedAuthentications(retry_after_ms)
        if digest is None or self._keys.refused(digest, now):
            # The budget had room (checked above): the failure is taken from it.
            self._failures.spend(client, now)
            self._metrics.count_auth_refusal("missing" if digest is None else "unknown_key")
            return AuthenticationFailed()
        return None

    async def _first_lookup(self, digest: bytes) -> tuple[KeyOwner | None, int]:
        task = self._first_lookups.get(digest)
        if task is None:
            task = asyncio.ensure_future(self._stamped_lookup(digest))
            self._first_lookups[digest] = task
            task.add_done_callback(lambda done: self._lookup_done(digest, done))
        # Shielded: one caller giving up must not cancel the others' lookup.
        return await asyncio.shield(task)

    async def _stamped_lookup(self, digest: bytes) -> tuple[KeyOwner | None, int]:
        since = self._keys.generation
        return await self._counted_lookup(digest, "first"), since

    def _lookup_done(self, digest: bytes, task: asyncio.Task[tuple[KeyOwner | None, int]]) -> None:
        self._first_lookups.pop(digest, None)
        if not task.cancelled():
            # Retrieved here, so that a lookup whose callers all left logs nothing.
            task.exception()

    def _start_refresh(self, digest: bytes) -> None:
        task = asyncio.ensure_future(self._refresh(digest))
        self._refreshes.add(task)
        task.add_done_callback(self._refreshes.discard)

    async def _refresh(self, digest: bytes) -> None:
        """Look a known key up again; meanwhile (and if the store is away) it serves as known."""
        since = self._keys.generation
        try:
            owner = await self._counted_lookup(digest, "refresh")
        except StoreUnavailable:
            return
        except Exception:
            log.warning("refreshing a cached API key failed", exc_info=True)
            return
        if owner is None:
            self._keys.refuse(digest, time.monotonic(), since)
        else:
            self._keys.confirm(digest, owner, time.monotonic(), since)

    async def _counted_lookup(self, digest: bytes, purpose: str) -> KeyOwner | None:
        try:
            owner = await self._lookup(digest)
        except StoreUnavailable:
            self._metrics.key_lookups.labels(purpose, "unavailable").inc()
            raise
        self._metrics.key_lookups.labels(purpose, "absent" if owner is None else "found").inc()
        return owner
