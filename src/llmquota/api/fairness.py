"""Per-tenant fair share of a worker: one tenant's flood waits in its own queue.

Without this, a tenant that opens many connections fills the worker's event
loop and its database pool, and every other tenant's request queues behind
its flood. With it, at most `max_in_progress` requests of one tenant are
being served by a worker at any moment; the tenant's further requests wait
their turn in that tenant's own queue (costing a coroutine, not CPU), and
past `max_waiting` they are refused at once with 429, before their body is
read. Other tenants' requests never wait behind that queue.

The lane is known before anything is parsed, from the authenticator's
memory (Authenticator.triage, no I/O): a known key's tenant (also while a key
it knew is looked up again after its row changed, keycache.py); the one lane of
keys this worker does not know yet, each of which costs a database lookup,
with its own small limits (`unknown_max_in_progress`, `unknown_max_waiting`),
so that a flood of invalid keys holds at most that many pooled connections
and queues behind itself only; or no lane (admin keys, endpoints that take
no API key). In the lane of unknown keys, a place is taken per key, not
per request: the first request with a key takes it, and the key's other
requests wait until that one is through the key's lookup (as many as the
tenant's lane would take at once, its permits and its queue; all keys
together, as many as the lanes of the keys looked up at once), then are
triaged once more and take the lane they are in: the tenant's if the key was
found, a 401 from memory if not, and the lane of unknown keys itself if the
store could not say (so that during an outage they share lookups there, 4 at
a time, as before). A worker that has just started, or a key just made,
would otherwise meet a tenant's first burst with the lane's 4 + 64 places and
refuse the rest with 429. (A wrong key's waiting requests are answered 401
from memory once its lookup is over, each spending its address's failure
budget.) A request without a key, with a key the worker knows is wrong, or
from a client address out of its failed-authentication budget is refused
here, before its body is read; the last one's 429 is held for its retry
hint (at most MAX_HOLD_SECONDS), so that a client hammering with wrong keys
gets about one answer per hint per connection instead of as many as the
worker's CPU can send. A proxied request gives its permit back once admitted
(RELEASE_EARLY). On the proxy paths every refusal here is in the provider's
format, with the headers its SDK retries by (llmquota.api.provider_errors).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Receive, Scope, Send

from llmquota.api.auth import (
    KEY_LOOKED_UP,
    UNKNOWN_KEYS_LANE,
    AuthenticationFailed,
    TooManyFailedAuthentications,
    Triage,
)
from llmquota.api.errors import send_auth_refusal, send_error
from llmquota.api.provider_errors import Kind, proxy_kind, send_provider_error
from llmquota.domain.refusals import ceil_seconds

TOO_MANY = 429
# Retry hint for a request refused because its lane's queue was full.
QUEUE_FULL_RETRY_MS = 100
# Longest a refusal for too many failed authentications is held before it is sent.
MAX_HOLD_SECONDS = 1.0
# Scope key of a callable giving the lane's permit back before the response
# ends: a proxied request calls it once admitted, so that a long provider call
# is bounded by the tenant's max_in_flight, not by this worker's gate.
RELEASE_EARLY = "llmquota.fair_share.release"


@dataclass
class _FirstUse:
    """The requests with one key this worker does not know, behind the first of them."""

    through: asyncio.Event = field(default_factory=asyncio.Event)
    waiting: int = 0


@dataclass
class _Gate:
    """One lane's share of this worker."""

    permits: asyncio.Semaphore
    waiting: int = 0
    users: int = field(default=0)


class TenantFairShare:
    """ASGI middleware bounding each lane's concurrent requests per worker."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        triage: Callable[[Scope], Triage],
        max_in_progress: int,
        max_waiting: int,
        unknown_max_in_progress: int,
        unknown_max_waiting: int,
    ) -> None:
        self.app = app
        self.triage = triage
        self.max_in_progress = max_in_progress
        self.max_waiting = max_waiting
        self.unknown_max_in_progress = unknown_max_in_progress
        self.unknown_max_waiting = unknown_max_waiting
        self._gates: dict[str, _Gate] = {}
        # Per digest of an unknown key, its first request's lookup to wait for;
        # and how many requests wait so, all keys together.
        self._first_uses: dict[bytes, _FirstUse] = {}
        self._following = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Triaged once, or twice for a request that waited for its key's first
        # request: then it takes whichever lane it is in, without waiting again.
        followed = False
        while True:
            triage = self.triage(scope) if scope["type"] == "http" else Triage()
            if triage.refusal is not None:
                if isinstance(triage.refusal, TooManyFailedAuthentications):
                    # Held for its retry hint (a sleeping coroutine, no CPU): a client
                    # that retries at once cannot spin the worker on refusals.
                    hold = min(triage.refusal.retry_after_ms / 1000, MAX_HOLD_SECONDS)
                    await asyncio.sleep(hold)
                await _refuse_auth(send, proxy_kind(scope), triage.refusal)
                return
            lane, key = triage.lane, triage.key
            if lane is None:
                await self.app(scope, receive, send)
                return
            if lane != UNKNOWN_KEYS_LANE or key is None or followed:
                await self._in_lane(lane, scope, receive, send)
                return
            first = self._first_uses.get(key)
            if first is None:
                await self._first_use(key, scope, receive, send)
                return
            if not await self._followed(first, scope, send):
                return
            followed = True

    async def _first_use(self, key: bytes, scope: Scope, receive: Receive, send: Send) -> None:
        """The first request with a key this worker does not know: the key's others
        wait until it is through the key's lookup (KEY_LOOKED_UP, called by the
        authenticator) or gives its place back, whichever comes first."""
        first = self._first_uses[key] = _FirstUse()

        def through() -> None:
            if self._first_uses.get(key) is first:
                del self._first_uses[key]
            first.through.set()

        scope[KEY_LOOKED_UP] = through
        try:
            await self._in_lane(UNKNOWN_KEYS_LANE, scope, receive, send, through)
        finally:
            through()

    async def _in_lane(
        self,
        lane: str,
        scope: Scope,
        receive: Receive,
        send: Send,
        on_release: Callable[[], None] | None = None,
    ) -> None:
        """Serve the request once its lane has a permit for it; 429 if its queue is full.
        `on_release` is called as the permit is given back (early on a proxy path)."""
        unknown = lane == UNKNOWN_KEYS_LANE
        max_waiting = self.unknown_max_waiting if unknown else self.max_waiting
        gate = self._gates.get(lane)
        if gate is None:
            permits = self.unknown_max_in_progress if unknown else self.max_in_progress
            gate = self._gates[lane] = _Gate(asyncio.Semaphore(permits))
        if gate.permits.locked() and gate.waiting >= max_waiting:
            await _refuse(send, proxy_kind(scope), *_queue_full(max_waiting, unknown))
            return
        gate.users += 1
        gate.waiting += 1
        held = False

        def release_early() -> None:
            nonlocal held
            if held:
                held = False
                gate.permits.release()
                if on_release is not None:
                    on_release()

        try:
            await gate.permits.acquire()
            held = True
            gate.waiting -= 1
            scope[RELEASE_EARLY] = release_early
            await self.app(scope, receive, send)
        finally:
            release_early()
            gate.users -= 1
            if gate.users == 0:
                # Idle lanes take no memory: the map holds only busy ones.
                self._gates.pop(lane, None)

    async def _followed(self, first: _FirstUse, scope: Scope, send: Send) -> bool:
        """Wait for the first request with the same key to be through its lookup;
        False (and 429) when as many of the key's requests wait already as its
        tenant's lane would take at once (its permits and its queue), or as many
        of all keys' as the lanes of the keys looked up at once would take (so
        that a flood of wrong keys parks no more than that)."""
        per_key = self.max_in_progress + self.max_waiting - 1
        in_all = self.unknown_max_in_progress * (self.max_in_progress + self.max_waiting)
        if first.waiting >= per_key or self._following >= in_all:
            message = (
                f"{per_key} requests with this key are already waiting for its first lookup "
                "on this worker; retry shortly"
                if first.waiting >= per_key
                else f"{in_all} requests with keys this worker has not seen yet are already "
                "waiting for their lookups; retry shortly"
            )
            await _refuse(send, proxy_kind(scope), message, "unknown_keys")
            return False
        first.waiting += 1
        self._following += 1
        try:
            await first.through.wait()
        finally:
            first.waiting -= 1
            self._following -= 1
        return True

    def waiting(self, lane: str) -> int:
        gate = self._gates.get(lane)
        return 0 if gate is None else gate.waiting


async def _refuse_auth(
    send: Send, kind: Kind | None, refusal: AuthenticationFailed | TooManyFailedAuthentications
) -> None:
    """A refused authentication: in the provider's format on a proxy path."""
    if kind is None:
        await send_auth_refusal(send, refusal)
    elif isinstance(refusal, TooManyFailedAuthentications):
        ms = refusal.retry_after_ms
        headers = [(b"retry-after", str(ceil_seconds(ms)).encode())]
        headers.append((b"retry-after-ms", str(ms).encode()))
        await send_provider_error(send, kind, TOO_MANY, str(refusal), headers=headers)
    else:
        message = "missing or invalid llmquota API key"
        await send_provider_error(send, kind, 401, message)


def _queue_full(max_waiting: int, unknown: bool) -> tuple[str, str]:
    """The message and scope of a 429 for a lane's full queue."""
    if unknown:
        return (
            f"{max_waiting} requests with keys this worker has not seen yet are already "
            "queued; retry shortly",
            "unknown_keys",
        )
    return (
        f"this tenant already has {max_waiting} requests queued on this worker; retry shortly",
        "tenant",
    )


async def _refuse(send: Send, kind: Kind | None, message: str, scope: str) -> None:
    headers = [
        (b"retry-after", b"1"),
        (b"retry-after-ms", str(QUEUE_FULL_RETRY_MS).encode()),
    ]
    if kind is not None:
        # OpenAI names the limit in the error's type, as the routes' own refusals do.
        error_type = "concurrency" if kind == "openai" else None
        await send_provider_error(
            send, kind, TOO_MANY, message, headers=headers, error_type=error_type
        )
        return
    await send_error(
        send,
        TOO_MANY,
        "rate_limit_error",
        headers=headers,
        limit="concurrency",
        scope=scope,
        message=message,
        retry_after_ms=QUEUE_FULL_RETRY_MS,
    )
