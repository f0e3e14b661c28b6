"""Settlements sent after their answers, and a tenant's next admission behind them.

A whole (non-stream) answer used to wait for its settlement: one statement and
its commit, about 1 ms of the proxy's added latency (BENCHMARKS.md, issue 25).
The answer now goes first and its settlement right behind it, in a task of
its own. (A stream's pump settles after its last event and before the
stream's end reaches the client: streams need none of this.) What that
must not change: a client that sends its next request as soon as the answer
arrives would otherwise find its finished request still holding its
reservation (the estimate, a max_in_flight permit) and could be refused for
it. So a tenant's next proxied request in this worker waits, before any
admission of its own, for that tenant's settlements still on their way: each
is one round trip, already sent, so the wait is what is left of one (with the
store unreachable, up to the decision deadline, after which the settlement is
journaled), and only for a tenant that has one. Only this worker's: with
several workers or replicas, a next request that lands on another may meet
the reservation still held for that moment. On shutdown
every settlement is awaited, none cancelled: each is bounded by the store's
deadline, and journaled for replay when the store does not answer
(Reservation.settle_upstream).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger("llmquota.proxy")


class SettlesInFlight:
    """The settlements this worker has started and not yet finished, by tenant."""

    def __init__(self) -> None:
        self._by_tenant: dict[str, set[asyncio.Task[None]]] = {}

    def start(self, tenant: str, settle: Coroutine[Any, Any, None]) -> None:
        """Run `settle` in a task of its own, held until it is done."""
        task = asyncio.get_running_loop().create_task(settle)
        self._by_tenant.setdefault(tenant, set()).add(task)
        task.add_done_callback(functools.partial(self._done, tenant))

    async def behind(self, tenant: str) -> None:
        """Wait until `tenant`'s settlements started before now are done."""
        running = self._by_tenant.get(tenant)
        if running:
            await asyncio.wait(set(running))

    async def close(self) -> None:
        """Wait for every settlement still running, those started meanwhile too
        (none is cancelled)."""
        while running := [task for tasks in self._by_tenant.values() for task in tasks]:
            await asyncio.wait(running)

    def _done(self, tenant: str, task: asyncio.Task[None]) -> None:
        tasks = self._by_tenant.get(tenant)
        if tasks is not None:
            tasks.discard(task)
            if not tasks:
                del self._by_tenant[tenant]
        if not task.cancelled() and (exc := task.exception()) is not None:
            # Exchange.finish logs the store's refusals itself: this is anything else.
            log.error("a settlement of tenant %r failed", tenant, exc_info=exc)
