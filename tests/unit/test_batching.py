"""The coalescer's grouping rules, with a real event loop and a recording batch function."""

from __future__ import annotations

import asyncio

import pytest

from llmquota.admission.batching import Coalescer


class Recorder:
    """A batch function that records its batches and can be held open."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.running = 0
        self.most_running = 0
        self.fail_with: Exception | None = None

    async def __call__(self, batch: list[int]) -> list[str]:
        self.batches.append(list(batch))
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            await self.gate.wait()
        finally:
            self.running -= 1
        if self.fail_with is not None:
            raise self.fail_with
        return [f"r{n}" for n in batch]


async def settle_loop(turns: int = 5) -> None:
    """Let the event loop run pending callbacks."""
    for _ in range(turns):
        await asyncio.sleep(0)


def coalescer(
    run: Recorder, *, size: int = 100, window: float = 1.0, in_flight: int = 1, **kw: object
) -> Coalescer[int, str]:
    return Coalescer(
        run,
        max_batch_size=size,
        window_seconds=window,
        max_in_flight=in_flight,
        **kw,  # type: ignore[arg-type]
    )


async def test_a_lone_request_goes_at_once_without_waiting_for_the_window() -> None:
    run = Recorder()
    c = coalescer(run, window=1.0, in_flight=4)
    # The window is a second; a lone caller with nothing in flight must not wait for it.
    assert await asyncio.wait_for(c.submit(7), timeout=0.5) == "r7"
    assert run.batches == [[7]]


async def test_callers_of_the_same_turn_share_one_batch() -> None:
    run = Recorder()
    c = coalescer(run)
    results = await asyncio.gather(*(c.submit(n) for n in range(10)))
    assert results == [f"r{n}" for n in range(10)]
    assert run.batches == [list(range(10))]


async def test_callers_arriving_while_a_batch_is_in_flight_join_the_next_in_arrival_order() -> None:
    run = Recorder()
    run.gate.clear()
    c = coalescer(run, in_flight=1)
    first = asyncio.create_task(c.submit(0))
    await settle_loop()
    assert run.batches == [[0]] and c.in_flight == 1
    later = [asyncio.create_task(c.submit(n)) for n in (5, 3, 9, 1)]
    await settle_loop()
    assert c.waiting == 4 and run.batches == [[0]]  # held: the only slot is busy
    run.gate.set()
    assert await first == "r0"
    assert [await t for t in later] == ["r5", "r3", "r9", "r1"]
    assert run.batches == [[0], [5, 3, 9, 1]]


async def test_batches_never_exceed_the_maximum_size() -> None:
    run = Recorder()
    run.gate.clear()
    c = coalescer(run, size=4, in_flight=1)
    first = asyncio.create_task(c.submit(0))
    await settle_loop()
    rest = [asyncio.create_task(c.submit(n)) for n in range(1, 11)]
    await settle_loop()
    run.gate.set()
    await asyncio.gather(first, *rest)
    assert run.batches == [[0], [1, 2, 3, 4], [5, 6, 7, 8], [9, 10]]


async def test_statements_in_flight_are_bounded() -> None:
    run = Recorder()
    run.gate.clear()
    c = coalescer(run, size=2, window=0.0, in_flight=3)
    tasks = [asyncio.create_task(c.submit(n)) for n in range(20)]
    await asyncio.sleep(0.05)
    assert c.in_flight == 3 and run.most_running == 3
    run.gate.set()
    assert await asyncio.gather(*tasks) == [f"r{n}" for n in range(20)]
    assert run.most_running == 3
    assert sorted(n for b in run.batches for n in b) == list(range(20))


async def test_after_the_window_a_second_batch_goes_while_the_first_is_in_flight() -> None:
    run = Recorder()
    run.gate.clear()
    c = coalescer(run, window=0.01, in_flight=2)
    first = asyncio.create_task(c.submit(0))
    await settle_loop()
    second = asyncio.create_task(c.submit(1))
    await asyncio.sleep(0.1)  # ten windows
    assert run.batches == [[0], [1]] and c.in_flight == 2
    run.gate.set()
    assert (await first, await second) == ("r0", "r1")


async def test_a_batch_failure_reaches_every_caller_of_that_batch_only() -> None:
    run = Recorder()
    run.gate.clear()
    c = coalescer(run, in_flight=1)
    ok = asyncio.create_task(c.submit(0))
    await settle_loop()
    doomed = [asyncio.create_task(c.submit(n)) for n in (1, 2, 3)]
    await settle_loop()
    run.gate.set()
    assert await ok == "r0"
    run.fail_with = ValueError("the statement failed")
    results = await asyncio.gather(*doomed, return_exceptions=True)
    assert [type(r) for r in results] == [ValueError] * 3
    assert run.batches == [[0], [1, 2, 3]]


async def test_a_wrong_number_of_results_is_an_error_for_the_whole_batch() -> None:
    async def short(batch: list[int]) -> list[str]:
        return ["only one"]

    c: Coalescer[int, str] = Coalescer(
        short, max_batch_size=10, window_seconds=0.0, max_in_flight=1
    )
    results = await asyncio.gather(c.submit(1), c.submit(2), return_exceptions=True)
    assert all(isinstance(r, RuntimeError) and "returned 1 results" in str(r) for r in results)


async def test_a_caller_cancelled_before_its_batch_goes_is_left_out() -> None:
    run = Recorder()
    run.gate.clear()
    c = coalescer(run, in_flight=1)
    first = asyncio.create_task(c.submit(0))
    await settle_loop()
    stays = asyncio.create_task(c.submit(1))
    leaves = asyncio.create_task(c.submit(2))
    await settle_loop()
    leaves.cancel()
    await settle_loop()
    run.gate.set()
    assert (await first, await stays) == ("r0", "r1")
    with pytest.raises(asyncio.CancelledError):
        await leaves
    assert run.batches == [[0], [1]]


async def test_a_caller_cancelled_in_flight_does_not_disturb_the_others() -> None:
    orphans: list[tuple[int, str]] = []
    run = Recorder()
    run.gate.clear()
    c = coalescer(run, on_orphan=lambda req, res: orphans.append((req, res)))
    tasks = [asyncio.create_task(c.submit(n)) for n in range(3)]
    await settle_loop()
    assert run.batches == [[0, 1, 2]]
    tasks[1].cancel()
    await settle_loop()
    run.gate.set()
    assert await tasks[0] == "r0" and await tasks[2] == "r2"
    assert tasks[1].cancelled()
    # The cancelled caller's result was decided and handed over, not lost.
    assert orphans == [(1, "r1")]


async def test_close_waits_for_gathered_and_running_batches() -> None:
    run = Recorder()
    run.gate.clear()
    c = coalescer(run, in_flight=1)
    tasks = [asyncio.create_task(c.submit(n)) for n in range(3)]
    await settle_loop()
    closing = asyncio.create_task(c.close())
    await settle_loop()
    assert not closing.done()
    run.gate.set()
    await closing
    assert [t.result() for t in tasks] == ["r0", "r1", "r2"]
    with pytest.raises(RuntimeError, match="closed"):
        await c.submit(9)


@pytest.mark.parametrize(
    ("size", "window", "in_flight"), [(0, 0.0, 1), (1, -0.1, 1), (1, 5.0, 1), (1, 0.0, 0)]
)
def test_bounds_are_checked(size: int, window: float, in_flight: int) -> None:
    with pytest.raises(ValueError):
        coalescer(Recorder(), size=size, window=window, in_flight=in_flight)
