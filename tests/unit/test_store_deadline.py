"""The decision deadline (store/deadline.py): on a batch's futures, as the coalescer
hands them over (DeadlineQueue), and on a coroutine (within_store_deadline).

Outcomes: what the caller gets and what becomes of the future its producer
holds; and one bound, that a loop's scheduling jitter is not credited as a
stall (it compounded: each credit's timer was as late as the last).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from llmquota.domain.errors import StoreTimeout
from llmquota.store.deadline import DeadlineQueue, within_store_deadline


def _timeout() -> StoreTimeout:
    return StoreTimeout("no answer")


async def test_an_answer_in_time_is_returned() -> None:
    future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_soon(future.set_result, 7)
    assert await DeadlineQueue(5.0, _timeout).watch(future) == 7


async def test_no_answer_fails_the_future_with_the_timeout() -> None:
    future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    with pytest.raises(StoreTimeout):
        await DeadlineQueue(0.01, _timeout).watch(future)
    # The producer sees it done: nobody will read an answer it sets later.
    assert future.done()
    assert isinstance(future.exception(), StoreTimeout)


async def test_each_future_of_a_queue_gets_its_own_deadline() -> None:
    loop = asyncio.get_running_loop()
    queue = DeadlineQueue(0.3, _timeout)
    answered: asyncio.Future[int] = loop.create_future()
    unanswered: asyncio.Future[int] = loop.create_future()
    late: asyncio.Future[int] = loop.create_future()
    queue.watch(answered)  # its deadline: 0.3 s from now
    await asyncio.sleep(0.1)
    queue.watch(unanswered)  # 0.4 s
    answered.set_result(1)
    await asyncio.sleep(0.25)
    queue.watch(late)  # 0.65 s
    # The first deadline has passed: the timer moved on to the next one.
    assert not unanswered.done()
    loop.call_later(0.15, late.set_result, 2)  # after 0.4 s, before 0.65 s
    with pytest.raises(StoreTimeout):
        await unanswered
    assert await late == 2


async def test_an_answer_that_waited_behind_a_stalled_loop_is_not_a_timeout() -> None:
    loop = asyncio.get_running_loop()
    future: asyncio.Future[int] = loop.create_future()
    waiting = asyncio.ensure_future(DeadlineQueue(0.02, _timeout).watch(future))
    await asyncio.sleep(0)  # the wait has started and its timer is set
    # The loop stalls for 0.1 s, far past the deadline: that lateness is given
    # back to the store, so an answer after the stall (and after the grace
    # turns) is still in time.
    loop.call_later(0.15, future.set_result, 3)
    time.sleep(0.1)  # noqa: ASYNC251 (the stall is the point)
    assert await waiting == 3


async def test_a_cancelled_caller_cancels_the_future() -> None:
    future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    queue = DeadlineQueue(5.0, _timeout)

    async def caller() -> int:
        return await queue.watch(future)

    waiting = asyncio.ensure_future(caller())
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert future.cancelled()


async def test_a_coroutine_runs_in_a_task_cancelled_on_timeout() -> None:
    started = asyncio.Event()
    cancelled = asyncio.Event()

    async def never() -> int:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return 0

    with pytest.raises(StoreTimeout):
        await within_store_deadline(never(), 0.01, _timeout)
    await asyncio.sleep(0)
    assert started.is_set()
    assert cancelled.is_set()


# A loop busy 10 ms every turn: each timer fires about that late.
JITTER_SECONDS = 0.01
JITTERY_DEADLINE_SECONDS = 0.05
# The deadline, its late timer and grace turns, with room for a loaded
# machine; crediting the jitter ran to MAX_LAG_CREDIT_SECONDS (5 s) here.
JITTERY_ANSWER_BOUND_SECONDS = JITTERY_DEADLINE_SECONDS + 0.15


async def _jitter_forever() -> None:
    while True:
        time.sleep(JITTER_SECONDS)  # noqa: ASYNC251 (a busy loop turn is the point)
        await asyncio.sleep(0)


@pytest.mark.parametrize("kind", ["queue", "coroutine"])
async def test_a_jittery_loop_is_not_credited_as_a_stall(kind: str) -> None:
    loop = asyncio.get_running_loop()
    never: asyncio.Future[int] = loop.create_future()
    jitter = asyncio.ensure_future(_jitter_forever())
    started = time.perf_counter()
    try:
        with pytest.raises(StoreTimeout):
            if kind == "queue":
                await DeadlineQueue(JITTERY_DEADLINE_SECONDS, _timeout).watch(never)
            else:
                await within_store_deadline(
                    asyncio.shield(never), JITTERY_DEADLINE_SECONDS, _timeout
                )
        took = time.perf_counter() - started
    finally:
        jitter.cancel()
    assert JITTERY_DEADLINE_SECONDS <= took < JITTERY_ANSWER_BOUND_SECONDS, took
