"""Deadlines that measure the store, not our own CPU.

A decision waits for PostgreSQL at most the decision deadline, and a failure
mode (refuse with 503, or admit without the store) applies only when the
store really took that long. A timer alone cannot tell: when the event loop
is busy (a big prompt being parsed, a burst of requests), the timer fires
late and the store's answer, already in the socket, is read after it. So
every wait here notices when it woke later than it asked to, and gives that
lateness back to the store before declaring a timeout: time the loop did
not run is time nobody could have read the answer, not time the store took.

The credit is bounded (MAX_LAG_CREDIT_SECONDS), so a loop that never
recovers still answers eventually.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

T = TypeVar("T")

# Waking this much later than asked is scheduling noise, not a stalled loop.
LAG_TOLERANCE_SECONDS = 0.005
# Most time a stalled loop can add to one wait.
MAX_LAG_CREDIT_SECONDS = 5.0
# Loop turns taken after a timer fires, so that I/O which arrived while the
# loop was busy is read before the wait gives up.
GRACE_TURNS = 3


async def within_store_deadline(
    awaitable: Awaitable[T], deadline_seconds: float, timed_out: Callable[[], Exception]
) -> T:
    """The awaitable's result, or `timed_out()` raised once the store has had
    `deadline_seconds` of time in which its answer could have been read.

    A coroutine runs in a task of its own, cancelled when the wait ends
    without its answer. A Future must be one only this caller waits on (a
    batch's answer for one request): it is awaited as it is, with no task,
    and on timeout it is failed with `timed_out()` rather than cancelled;
    either way its producer sees it done and knows nobody will read it.
    """
    if not asyncio.isfuture(awaitable) or isinstance(awaitable, asyncio.Task):
        return await _task_within(asyncio.ensure_future(awaitable), deadline_seconds, timed_out)
    future = cast("asyncio.Future[T]", awaitable)
    watch = _Watch(future, deadline_seconds, timed_out)
    try:
        return await future
    finally:
        watch.stop()


class _Watch:
    """The deadline of one future, kept by timer callbacks: no task, no waiter.

    It measures what _task_within measures, in callbacks: when the timer
    fires late, the lateness is credited back (bounded); otherwise the
    future gets GRACE_TURNS more loop turns before it is failed.
    """

    __slots__ = ("_asked", "_budget", "_credit", "_future", "_handle", "_loop", "_timed_out")

    def __init__(
        self, future: asyncio.Future[T], deadline_seconds: float, timed_out: Callable[[], Exception]
    ) -> None:
        self._future: asyncio.Future[Any] = future
        self._timed_out = timed_out
        self._loop = asyncio.get_running_loop()
        self._credit = 0.0
        self._arm(deadline_seconds)

    def _arm(self, budget: float) -> None:
        self._budget = budget
        self._asked = self._loop.time()
        self._handle: asyncio.Handle = self._loop.call_at(self._asked + budget, self._fired)

    def _fired(self) -> None:
        if self._future.done():
            return
        lateness = self._loop.time() - self._asked - self._budget
        self._handle = self._loop.call_soon(self._grace, lateness, GRACE_TURNS)

    def _grace(self, lateness: float, turns_left: int) -> None:
        if self._future.done():
            return
        if turns_left > 1:
            self._handle = self._loop.call_soon(self._grace, lateness, turns_left - 1)
        elif lateness < LAG_TOLERANCE_SECONDS or self._credit >= MAX_LAG_CREDIT_SECONDS:
            self._future.set_exception(self._timed_out())
        else:
            budget = min(lateness, MAX_LAG_CREDIT_SECONDS - self._credit)
            self._credit += budget
            self._arm(budget)

    def stop(self) -> None:
        self._handle.cancel()


async def _task_within(
    future: asyncio.Future[T], deadline_seconds: float, timed_out: Callable[[], Exception]
) -> T:
    """within_store_deadline for a task: waits, then cancels it on timeout."""
    loop = asyncio.get_running_loop()
    budget, credit = deadline_seconds, 0.0
    try:
        while True:
            asked = loop.time()
            if not future.done():
                await _done_or_timeout(loop, future, budget)
            if future.done():
                return future.result()
            lateness = loop.time() - asked - budget
            for _ in range(GRACE_TURNS):
                await asyncio.sleep(0)
                if future.done():
                    return future.result()
            if lateness < LAG_TOLERANCE_SECONDS or credit >= MAX_LAG_CREDIT_SECONDS:
                raise timed_out()
            budget = min(lateness, MAX_LAG_CREDIT_SECONDS - credit)
            credit += budget
    finally:
        if not future.done():
            future.cancel()


async def _done_or_timeout(
    loop: asyncio.AbstractEventLoop, future: asyncio.Future[T], timeout_seconds: float
) -> None:
    """Return when `future` is done or `timeout_seconds` passed, whichever is first.

    asyncio.wait for one future, without the sets and the extra callbacks: this
    runs once per decision. Cancelling the caller does not cancel `future`.
    """
    waiter: asyncio.Future[None] = loop.create_future()
    wake = functools.partial(_wake, waiter)
    timer = loop.call_later(timeout_seconds, wake, None)
    future.add_done_callback(wake)
    try:
        await waiter
    finally:
        timer.cancel()
        future.remove_done_callback(wake)


def _wake(waiter: asyncio.Future[None], _: object) -> None:
    if not waiter.done():
        waiter.set_result(None)
