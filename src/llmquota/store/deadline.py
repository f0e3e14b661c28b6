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
recovers still answers eventually. And only a stall is credited, not the
loop's scheduling jitter (LAG_TOLERANCE_SECONDS): a credit re-arms a timer,
and on a busy 2-core machine every timer fires 10-40 ms late, so crediting
jitter re-armed a timer as late as the last one, over and over, and a hung
store's 503 took up to 0.9 s instead of the 250 ms deadline (profiled in
tests/faults/test_auth_outage.py). A stall worth crediting is a blocking
call of a hundred milliseconds or more (a huge prompt counted on the loop):
each one is credited, as the statement it delayed may not have been sent.
"""

from __future__ import annotations

import asyncio
import collections
import functools
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")

# Waking this much later than asked is scheduling noise, not a stalled loop:
# a timer is mostly 10-40 ms late on a loaded 2-core machine (a rare 50-80 ms
# with three CPU hogs beside the server: credited, and the timer it re-arms
# is back in the noise), far below the stalls that matter.
LAG_TOLERANCE_SECONDS = 0.05
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

    It runs in a task of its own, cancelled when the wait ends without its
    answer. (A batch's answer for one request is a future: DeadlineQueue.)
    """
    return await _task_within(asyncio.ensure_future(awaitable), deadline_seconds, timed_out)


class DeadlineQueue:
    """The deadlines of futures that all wait `deadline_seconds`, with one timer.

    A batch's answer for one request is a future only its caller waits on.
    Every such future of one kind (admissions, finishes) waits the same
    deadline from the moment it is queued, so their deadlines come in arrival
    order, and one timer, set for the oldest future still waiting, keeps them
    all: no task, no timer handle armed and cancelled per decision. A future
    still waiting when its deadline passes gets a _Watch of its own from then
    on (the same grace turns and lateness credit as a wait by itself), and
    is at last failed with `timed_out()` rather than cancelled, so its
    producer sees it done and knows nobody will read it. Cancelling the
    caller cancels the future, as awaiting any future does.
    """

    __slots__ = ("_deadline_seconds", "_loop", "_timed_out", "_timer", "_waiting")

    def __init__(self, deadline_seconds: float, timed_out: Callable[[], Exception]) -> None:
        self._deadline_seconds = deadline_seconds
        self._timed_out = timed_out
        # (future, the loop's clock when it was queued), oldest first.
        self._waiting: collections.deque[tuple[asyncio.Future[Any], float]] = collections.deque()
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def watch(self, future: asyncio.Future[T]) -> asyncio.Future[T]:
        """Keep `future`'s deadline from now; returns it, to be awaited."""
        loop = asyncio.get_running_loop()
        waiting = self._waiting
        if loop is not self._loop:
            # A new event loop (one per test, say): the old one's futures and
            # timer are gone with it. One loop at a time, as for the Limiter.
            waiting.clear()
            self._loop, self._timer = loop, None
        # Answers come back in about arrival order: dropping the answered
        # ones here keeps the queue as short as the calls in flight.
        while waiting and waiting[0][0].done():
            waiting.popleft()
        waiting.append((future, loop.time()))
        if self._timer is None:
            self._arm(loop)
        return future

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = loop.call_at(self._waiting[0][1] + self._deadline_seconds, self._fired)

    def _fired(self) -> None:
        """Hand every future past its deadline and unanswered to a _Watch."""
        self._timer = None
        loop, waiting = self._loop, self._waiting
        assert loop is not None
        now = loop.time()
        while waiting:
            future, asked = waiting[0]
            if not future.done():
                if asked + self._deadline_seconds > now:
                    break
                _Watch(future, self._deadline_seconds, self._timed_out, asked=asked)
            waiting.popleft()
        if waiting:
            self._arm(loop)


class _Watch:
    """The deadline of one future past its first timer, kept by callbacks.

    It measures what _task_within measures, in callbacks: when the timer
    fired late, the lateness is credited back (bounded); otherwise the
    future gets GRACE_TURNS more loop turns before it is failed. Each
    callback first checks whether the future was answered meanwhile, so
    nothing needs cancelling when it is.
    """

    __slots__ = ("_asked", "_budget", "_credit", "_future", "_loop", "_timed_out")

    def __init__(
        self,
        future: asyncio.Future[T],
        deadline_seconds: float,
        timed_out: Callable[[], Exception],
        *,
        asked: float,
    ) -> None:
        """Start as a timer set at `asked` for `deadline_seconds` that has just fired."""
        self._future: asyncio.Future[Any] = future
        self._timed_out = timed_out
        self._loop = asyncio.get_running_loop()
        self._credit = 0.0
        self._budget = deadline_seconds
        self._asked = asked
        self._fired()

    def _arm(self, budget: float) -> None:
        self._budget = budget
        self._asked = self._loop.time()
        self._loop.call_at(self._asked + budget, self._fired)

    def _fired(self) -> None:
        if self._future.done():
            return
        lateness = self._loop.time() - self._asked - self._budget
        self._loop.call_soon(self._grace, lateness, GRACE_TURNS)

    def _grace(self, lateness: float, turns_left: int) -> None:
        if self._future.done():
            return
        if turns_left > 1:
            self._loop.call_soon(self._grace, lateness, turns_left - 1)
        elif lateness < LAG_TOLERANCE_SECONDS or self._credit >= MAX_LAG_CREDIT_SECONDS:
            self._future.set_exception(self._timed_out())
        else:
            budget = min(lateness, MAX_LAG_CREDIT_SECONDS - self._credit)
            self._credit += budget
            self._arm(budget)


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
