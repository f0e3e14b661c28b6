"""An allotment worker's background tasks: waited for without spinning, and
a journal write begun before the store came back does not answer for a later
one.

A finished task leaves `Allotments._tasks` by a done callback, which runs on
the next turn of the event loop. On Python 3.12+, awaiting `asyncio.gather`
of tasks that are all finished does not yield to the loop, so the old
`while tasks: await gather(*tasks)` in `background_done` (and `close`, which
calls it) spun for ever once it met such a task: CI's Python 3.13 leg timed
out in it. On 3.11 gather yields, so there this test passes either way.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from typing import Any, cast

import pytest

from llmquota.admission.allotments import Allotments, Slice
from llmquota.admission.policy_cache import PolicyCache
from llmquota.config import Settings
from llmquota.domain.errors import StoreUnavailable
from llmquota.store.allotments import SliceAdmission, SliceKey


async def test_background_done_returns_while_a_finished_task_is_still_in_the_set() -> None:
    settings = Settings(_env_file=None)  # type: ignore[call-arg]
    policies = PolicyCache(refresh_seconds=10, max_stale_seconds=60)
    allotments = Allotments(cast(Any, None), settings, policies, lambda _decisions: None)

    async def quick() -> None:
        return None

    allotments._spawn(quick())
    await asyncio.sleep(0)  # it runs and finishes; it leaves the set on the next turn
    assert allotments._tasks and all(task.done() for task in allotments._tasks)
    await allotments.background_done()
    assert not allotments._tasks


class ScriptedJournal:
    """The journal's store: the first write fails once `fail` is set (the
    store was away when it began); every later write is taken."""

    def __init__(self) -> None:
        self.fail = asyncio.Event()
        self.writes = 0
        self.written: list[uuid.UUID] = []

    async def journal(
        self, admissions: Sequence[SliceAdmission], hold_seconds: int, deadline_seconds: float
    ) -> dict[uuid.UUID, bool]:
        self.writes += 1
        if self.writes == 1:
            await self.fail.wait()
            raise StoreUnavailable("database unavailable: connection refused")
        self.written += [a.reservation_id for a in admissions]
        return {a.allotment_id: True for a in admissions}


def journaled_once(store: ScriptedJournal | AwayJournal) -> tuple[Allotments, SliceAdmission]:
    settings = Settings(_env_file=None)  # type: ignore[call-arg]
    policies = PolicyCache(refresh_seconds=10, max_stale_seconds=60)
    allotments = Allotments(cast(Any, store), settings, policies, lambda _decisions: None)
    held = Slice(SliceKey("acme", None, "gpt-4o", None))
    admission = SliceAdmission(held.allotment_id, uuid.uuid4(), 100, False, 400, 500, None, None)
    allotments.pending.append((held, admission))
    return allotments, admission


async def test_a_write_begun_while_the_store_was_away_does_not_fail_a_later_write_journal() -> None:
    store = ScriptedJournal()
    allotments, admission = journaled_once(store)
    allotments._start_writing()  # the journal timer's write, begun while the store is away
    await asyncio.sleep(0)
    assert store.writes == 1

    # The store is back; the old write's refusal arrives while this call waits on it.
    waiting = asyncio.ensure_future(allotments.write_journal())
    await asyncio.sleep(0)
    store.fail.set()
    await waiting

    assert store.writes == 2
    assert store.written == [admission.reservation_id]
    assert not allotments.pending


async def test_a_write_journal_whose_own_write_fails_says_so_and_keeps_the_admissions() -> None:
    store = ScriptedJournal()
    store.fail.set()
    allotments, admission = journaled_once(store)
    with pytest.raises(StoreUnavailable):
        await allotments.write_journal()
    assert store.writes == 1
    assert [a for _s, a in allotments.pending] == [admission]
    await allotments.write_journal()
    assert store.written == [admission.reservation_id]


class AwayJournal:
    """The journal's store while the store stays away: every write fails, a
    little later."""

    def __init__(self) -> None:
        self.writes = 0

    async def journal(
        self, admissions: Sequence[SliceAdmission], hold_seconds: int, deadline_seconds: float
    ) -> dict[uuid.UUID, bool]:
        self.writes += 1
        await asyncio.sleep(0.001)
        raise StoreUnavailable("database unavailable: connection refused")


async def test_a_write_journal_answers_while_the_store_stays_away_whatever_else_writes() -> None:
    # Admissions keep beginning writes (a full batch starts one at once): the
    # call still answers, from the first write it did not find under way.
    store = AwayJournal()
    allotments, _admission = journaled_once(cast(Any, store))
    allotments._start_writing()  # under way when the call begins: excused once

    async def admissions() -> None:
        while True:
            allotments._start_writing()
            await asyncio.sleep(0)

    busy = asyncio.ensure_future(admissions())
    try:
        with pytest.raises(StoreUnavailable):
            await asyncio.wait_for(allotments.write_journal(), timeout=5)
    finally:
        busy.cancel()
    assert store.writes <= 4
