"""Per-tenant fair share of a worker: one tenant's flood waits in its own queue.

Without this, a tenant that opens many connections fills the worker's event
loop and its database pool, and every other tenant's request queues behind
its flood. With it, at most `max_in_progress` requests of one tenant are
being served by a worker at any moment; the tenant's further requests wait
their turn in that tenant's own queue (costing a coroutine, not CPU), and
past `max_waiting` they are refused at once with 429, before their body is
read. Other tenants' requests never wait behind that queue.

The tenant is known before anything is parsed: the bearer key's digest is
looked up in the authenticator's per-worker cache (a key not seen yet passes
through once, and its lookup fills the cache). Admin requests are not gated.
A proxied request gives its permit back once admitted (RELEASE_EARLY).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Receive, Scope, Send

from llmquota.api.errors import send_error

TOO_MANY = 429
# Retry hint for a request refused because its tenant's queue was full.
QUEUE_FULL_RETRY_MS = 100
# Scope key of a callable giving the tenant's permit back before the response
# ends: a proxied request calls it once admitted, so that a long provider call
# is bounded by the tenant's max_in_flight, not by this worker's gate.
RELEASE_EARLY = "llmquota.fair_share.release"


@dataclass
class _Gate:
    """One tenant's share of this worker."""

    permits: asyncio.Semaphore
    waiting: int = 0
    users: int = field(default=0)


class TenantFairShare:
    """ASGI middleware bounding each tenant's concurrent requests per worker."""

    def __init__(
        self,
        app: ASGIApp,
        tenant_of: Callable[[Scope], str | None],
        max_in_progress: int,
        max_waiting: int,
    ) -> None:
        self.app = app
        self.tenant_of = tenant_of
        self.max_in_progress = max_in_progress
        self.max_waiting = max_waiting
        self._gates: dict[str, _Gate] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        tenant = self.tenant_of(scope) if scope["type"] == "http" else None
        if tenant is None:
            await self.app(scope, receive, send)
            return
        gate = self._gates.get(tenant)
        if gate is None:
            gate = self._gates[tenant] = _Gate(asyncio.Semaphore(self.max_in_progress))
        if gate.permits.locked() and gate.waiting >= self.max_waiting:
            await _refuse(send, self.max_waiting)
            return
        gate.users += 1
        gate.waiting += 1
        held = False

        def release_early() -> None:
            nonlocal held
            if held:
                held = False
                gate.permits.release()

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
                # Idle tenants take no memory: the map holds only busy ones.
                self._gates.pop(tenant, None)

    def waiting(self, tenant: str) -> int:
        gate = self._gates.get(tenant)
        return 0 if gate is None else gate.waiting


async def _refuse(send: Send, max_waiting: int) -> None:
    await send_error(
        send,
        TOO_MANY,
        "rate_limit_error",
        headers=[
            (b"retry-after", b"1"),
            (b"retry-after-ms", str(QUEUE_FULL_RETRY_MS).encode()),
        ],
        limit="concurrency",
        scope="tenant",
        message=f"this tenant already has {max_waiting} requests queued on this "
        "worker; retry shortly",
        retry_after_ms=QUEUE_FULL_RETRY_MS,
    )
