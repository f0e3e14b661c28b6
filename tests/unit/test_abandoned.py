"""The journal of given-up admission statements: what it keeps, and for how long."""

from __future__ import annotations

import uuid

from llmquota.admission.abandoned import AbandonedAdmissions
from llmquota.domain.records import FinishRequest, FinishResult


def result(status: str) -> FinishResult:
    return FinishResult(
        status=status,
        state=None,
        tenant=None,
        charged_tokens=None,
        refunded_tokens=None,
        late=None,
        excess_tokens=None,
    )


async def test_missing_ids_are_looked_for_until_their_statement_cannot_commit() -> None:
    released, settled, missing = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    store = {released: "released", settled: "conflict", missing: "not_found"}
    asked: list[list[uuid.UUID]] = []

    async def finish(requests: list[FinishRequest]) -> list[FinishResult]:
        assert {r.action for r in requests} == {"release"}
        asked.append([r.reservation_id for r in requests])
        return [result(store[r.reservation_id]) for r in requests]

    journal = AbandonedAdmissions(max_entries=10, settle_seconds=5.0)
    journal.abandon([released, settled, missing])
    assert await journal.release(finish, batch_size=2, now=100.0) == 1
    assert asked == [[released, settled], [missing]]  # two statements of at most 2
    assert len(journal) == 1  # the missing one, first found missing at 100 s
    assert await journal.release(finish, batch_size=2, now=104.9) == 0
    assert len(journal) == 1
    store[missing] = "released"  # its statement committed late, after all
    assert await journal.release(finish, batch_size=2, now=104.95) == 1
    assert len(journal) == 0


async def test_a_missing_id_is_forgotten_once_it_can_no_longer_appear() -> None:
    async def finish(requests: list[FinishRequest]) -> list[FinishResult]:
        return [result("not_found") for _ in requests]

    journal = AbandonedAdmissions(max_entries=10, settle_seconds=5.0)
    journal.abandon([uuid.uuid4()])
    await journal.release(finish, batch_size=10, now=100.0)
    await journal.release(finish, batch_size=10, now=105.0)
    assert len(journal) == 0


def test_the_journal_is_bounded() -> None:
    journal = AbandonedAdmissions(max_entries=3, settle_seconds=5.0)
    journal.abandon([uuid.uuid4() for _ in range(5)])
    assert (len(journal), journal.dropped) == (3, 2)
