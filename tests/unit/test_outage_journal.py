"""The outage journal's spool keeps when each admission and settle happened."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from pathlib import Path

from llmquota.admission.outage import OutageEntry, OutageJournal
from llmquota.domain.records import AdmitRequest, FinishRequest

ADMITTED = datetime(2026, 12, 1, 23, 59, 30, 125_000, tzinfo=UTC)
SETTLED = datetime(2026, 12, 1, 23, 59, 58, tzinfo=UTC)


def test_an_adopted_spool_keeps_the_moments_of_admission_and_settle(tmp_path: Path) -> None:
    dead = OutageJournal(max_entries=10, spool_dir=tmp_path)
    request = AdmitRequest("acme", None, "gpt-4o", 10, 90, False, None, None, None)
    settled = OutageEntry(uuid.UUID(int=1), request, "open", 3, admitted_at=ADMITTED)
    open_one = OutageEntry(uuid.UUID(int=2), request, "local", 3, admitted_at=ADMITTED)
    dead.add(settled)
    dead.add(open_one)
    dead.set_finish(
        settled, FinishRequest(settled.reservation_id, "settle", None, 10, 5, "ok"), SETTLED
    )
    dead.close()  # its worker is gone; the file stays with two entries

    adopter = OutageJournal(max_entries=10, spool_dir=tmp_path)
    first, second = adopter.get(uuid.UUID(int=1)), adopter.get(uuid.UUID(int=2))
    assert first is not None and second is not None
    assert (first.admitted_at, first.finished_at) == (ADMITTED, SETTLED)
    assert first.finish == FinishRequest(uuid.UUID(int=1), "settle", None, 10, 5, "ok")
    assert (second.admitted_at, second.finished_at, second.finish) == (ADMITTED, None, None)
    adopter.close()
