"""Group admission: coalesce concurrent calls of one process into batch statements.

A row lock is held until commit, and commit waits for the WAL flush, so one
statement per request serializes every request that touches a busy row (a
hot tenant, and the global layer, which every request touches) at a few
thousand per second. The admission functions already take arrays and decide
a batch in arrival order, so the cure is on this side: callers arriving
while a statement is in flight wait for it and then go together in the next
one. The rows are then locked and the WAL flushed once per batch instead of
once per request.

When a batch goes:
- at once (on the next turn of the event loop) when nothing is in flight, so
  a lone request does not wait;
- when a statement in flight finishes, taking whatever gathered meanwhile;
- when the oldest waiting caller has waited `window_seconds` and fewer than
  `max_in_flight` statements are running (pipelining on a busy system);
- when `max_batch_size` callers are waiting and a slot is free.

A batch's failure is every one of its callers' failure; `run` may instead
put an exception in the place of one request's result, and only that caller
gets it (the limiter does, for a request whose data the database refused,
so that one request cannot fail the others). A caller cancelled
before its batch went is simply left out; one cancelled while its batch is in
flight does not disturb the others, and its result is handed to `on_orphan`
(the limiter releases an admission nobody will ever use).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from llmquota.config import MAX_BATCH_SIZE, MAX_BATCH_WINDOW_SECONDS, MAX_BATCHES_IN_FLIGHT

Req = TypeVar("Req")
Res = TypeVar("Res")


@dataclass(slots=True)
class _Waiter(Generic[Req, Res]):
    request: Req
    future: asyncio.Future[Res]
    # The loop's clock when it arrived.
    arrived: float


class Coalescer(Generic[Req, Res]):
    """Runs `run(batch) -> results` for groups of concurrent `submit` calls.

    `run` must return one result per request, in the same order. Results are
    exactly what `run` decides for the batch; this class adds no semantics of
    its own beyond grouping and ordering (arrival order is preserved).
    """

    def __init__(
        self,
        run: Callable[[list[Req]], Awaitable[Sequence[Res | Exception]]],
        *,
        max_batch_size: int,
        window_seconds: float,
        max_in_flight: int,
        on_orphan: Callable[[Req, Res], None] | None = None,
    ) -> None:
        if not 1 <= max_batch_size <= MAX_BATCH_SIZE:
            raise ValueError(f"max_batch_size must be from 1 to {MAX_BATCH_SIZE}")
        if not 0 <= window_seconds <= MAX_BATCH_WINDOW_SECONDS:
            raise ValueError(f"window_seconds must be from 0 to {MAX_BATCH_WINDOW_SECONDS}")
        if not 1 <= max_in_flight <= MAX_BATCHES_IN_FLIGHT:
            raise ValueError(f"max_in_flight must be from 1 to {MAX_BATCHES_IN_FLIGHT}")
        self._run = run
        self._max_batch_size = max_batch_size
        self._window_seconds = window_seconds
        self._max_in_flight = max_in_flight
        self._on_orphan = on_orphan
        self._waiting: collections.deque[_Waiter[Req, Res]] = collections.deque()
        self._tasks: set[asyncio.Task[None]] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._flush_soon: asyncio.Handle | None = None
        self._closed = False

    @property
    def in_flight(self) -> int:
        """Batch statements running now."""
        return len(self._tasks)

    @property
    def waiting(self) -> int:
        """Callers gathered for the next batch."""
        return len(self._waiting)

    async def submit(self, request: Req) -> Res:
        """Decide `request` together with whoever else is asking now."""
        return await self.enqueue(request)

    def enqueue(self, request: Req) -> asyncio.Future[Res]:
        """`submit` without the coroutine: the future of `request`'s result.

        Cancelling the future is the caller leaving: a batch not yet sent
        leaves it out, a batch in flight delivers its result to on_orphan.
        """
        if self._closed:
            raise RuntimeError("coalescer is closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Res] = loop.create_future()
        self._waiting.append(_Waiter(request, future, loop.time()))
        self._schedule(loop)
        return future

    async def close(self) -> None:
        """Refuse new callers and wait for the batches already gathered or running."""
        self._closed = True
        while self._waiting or self._tasks:
            if self._waiting and len(self._tasks) < self._max_in_flight:
                self._launch()
            elif self._tasks:
                await asyncio.wait(set(self._tasks))
        self._cancel_timers()

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        """Decide when the waiting callers go; never blocks."""
        if not self._waiting or len(self._tasks) >= self._max_in_flight:
            return  # a finishing batch calls us again
        if not self._tasks or len(self._waiting) >= self._max_batch_size:
            # Go on the next turn of the loop, so callers woken in the same turn
            # (say, by the previous batch's results) join this batch.
            if self._flush_soon is None:
                self._flush_soon = loop.call_soon(self._flush)
            return
        if self._timer is None:
            waited = loop.time() - self._waiting[0].arrived
            self._timer = loop.call_later(max(0.0, self._window_seconds - waited), self._on_window)

    def _on_window(self) -> None:
        self._timer = None
        if self._waiting and len(self._tasks) < self._max_in_flight:
            self._flush()

    def _flush(self) -> None:
        self._flush_soon = None
        self._launch()
        self._schedule(asyncio.get_running_loop())

    def _launch(self) -> None:
        """Send up to max_batch_size waiting callers, oldest first, as one batch."""
        batch: list[_Waiter[Req, Res]] = []
        while self._waiting and len(batch) < self._max_batch_size:
            waiter = self._waiting.popleft()
            if not waiter.future.done():  # cancelled before its batch went
                batch.append(waiter)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not batch:
            return
        task = asyncio.create_task(self._execute(batch))
        self._tasks.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        with contextlib.suppress(RuntimeError):  # the loop is closing
            self._schedule(asyncio.get_running_loop())

    async def _execute(self, batch: list[_Waiter[Req, Res]]) -> None:
        try:
            results = await self._run([w.request for w in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"batch of {len(batch)} returned {len(results)} results")
        except BaseException as exc:
            for waiter in batch:
                if not waiter.future.done():
                    if isinstance(exc, asyncio.CancelledError):
                        waiter.future.cancel()
                    else:
                        waiter.future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        for waiter, result in zip(batch, results, strict=True):
            if isinstance(result, Exception):
                if not waiter.future.done():
                    waiter.future.set_exception(result)
            elif not waiter.future.done():
                waiter.future.set_result(result)
            elif self._on_orphan is not None:
                self._on_orphan(waiter.request, result)

    def _cancel_timers(self) -> None:
        for handle in (self._timer, self._flush_soon):
            if handle is not None:
                handle.cancel()
        self._timer = self._flush_soon = None


async def isolating(
    run: Callable[[list[Req]], Awaitable[Sequence[Res]]],
    requests: list[Req],
    isolate: type[Exception],
) -> list[Res | Exception]:
    """Run a batch; when it fails with `isolate` (an error tied to one request's
    data, not to the database), run its halves apart, down to the requests at
    fault, which alone get the error in place of a result.

    The halves run one after the other in arrival order, so each request is
    decided exactly as the whole batch would have decided it without the
    requests at fault. A poisoned batch costs about 2 log2(n) statements.
    """
    try:
        return list(await run(requests))
    except isolate as exc:
        if len(requests) == 1:
            return [exc]
    middle = len(requests) // 2
    first = await isolating(run, requests[:middle], isolate)
    return [*first, *await isolating(run, requests[middle:], isolate)]


def single(results: Sequence[Res | Exception]) -> Res:
    """The one result of a batch of one, raising the error put in its place."""
    (result,) = results
    if isinstance(result, Exception):
        raise result
    return result
