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
from collections.abc import Awaitable, Callable
from typing import TypeVar

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
    `deadline_seconds` of time in which its answer could have been read."""
    task = asyncio.ensure_future(awaitable)
    loop = asyncio.get_running_loop()
    budget, credit = deadline_seconds, 0.0
    try:
        while True:
            asked = loop.time()
            done, _ = await asyncio.wait({task}, timeout=budget)
            if done:
                return task.result()
            lateness = loop.time() - asked - budget
            for _ in range(GRACE_TURNS):
                await asyncio.sleep(0)
                if task.done():
                    return task.result()
            if lateness < LAG_TOLERANCE_SECONDS or credit >= MAX_LAG_CREDIT_SECONDS:
                raise timed_out()
            budget = min(lateness, MAX_LAG_CREDIT_SECONDS - credit)
            credit += budget
    finally:
        if not task.done():
            task.cancel()
