"""The outage journal's settlements of reservations the store holds: kept,
spooled, adopted from a stopped worker, replayed once and then forgotten."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from llmquota.admission.outage import JournalFull, OutageJournal
from llmquota.domain.records import FinishRequest, FinishResult


class FakeStore:
    """Records the finish batches it is sent; answers each `settled`."""

    def __init__(self) -> None:
        self.finished: list[list[FinishRequest]] = []

    async def finish(
        self, requests: Sequence[FinishRequest], *, deadline_seconds: float | None = None
    ) -> list[FinishResult]:
        self.finished.append(list(requests))
        return [FinishResult("settled", "settled", r.caller, 1, 0, False) for r in requests]

    async def record_outage_admissions(self, *_args: Any, **_kwargs: Any) -> None:
        raise AssertionError("no admission was journaled")


def settle(output_tokens: int = 13, reported: int | None = None) -> FinishRequest:
    return FinishRequest(
        uuid.uuid4(),
        "settle",
        "acme",
        17,
        output_tokens,
        "ok",
        usage_source="clamped" if reported else "reported",
        reported_output_tokens=reported,
    )


async def test_a_journaled_settlement_is_replayed_once_and_forgotten() -> None:
    journal = OutageJournal(max_entries=10)
    finish = settle()
    journal.add_settlement(finish)
    assert len(journal) == 1
    store = FakeStore()
    report = await journal.flush(store, batch_size=8, deadline_seconds=None)  # type: ignore[arg-type]
    assert store.finished == [[finish]]
    assert (report.admissions_recorded, report.finishes_recorded) == (0, 1)
    assert len(journal) == 0
    await journal.flush(store, batch_size=8, deadline_seconds=None)  # type: ignore[arg-type]
    assert len(store.finished) == 1  # nothing sent twice


async def test_a_full_journal_refuses_a_settlement_and_only_a_settlement_is_taken() -> None:
    journal = OutageJournal(max_entries=1)
    journal.add_settlement(settle())
    with pytest.raises(JournalFull):
        journal.add_settlement(settle())
    with pytest.raises(ValueError, match="only a settlement"):
        journal.add_settlement(FinishRequest(uuid.uuid4(), "release", "acme"))
    assert len(journal) == 1


def spool_files(directory: Path) -> list[Path]:
    return list(directory.glob("spool-*.jsonl"))


async def test_a_stopped_workers_settlements_are_adopted_with_their_figures(
    tmp_path: Path,
) -> None:
    stopped = OutageJournal(max_entries=10, spool_dir=tmp_path)
    # A figure no bigint holds survives the spool as it was reported.
    first, second = settle(reported=10**30), settle(output_tokens=5)
    stopped.add_settlement(first)
    stopped.add_settlement(second)
    stopped.close()  # the file stays: it holds unflushed settlements
    assert len(spool_files(tmp_path)) == 1

    adopting = OutageJournal(max_entries=1, spool_dir=tmp_path)
    assert len(adopting) == 2  # adopted whatever its own bound: never dropped
    store = FakeStore()
    await adopting.flush(store, batch_size=8, deadline_seconds=None)  # type: ignore[arg-type]
    assert store.finished == [[first, second]]
    assert store.finished[0][0].reported_output_tokens == 10**30
    assert store.finished[0][0].usage_source == "clamped"
    assert len(adopting) == 0
    adopting.close()
    assert spool_files(tmp_path) == []
