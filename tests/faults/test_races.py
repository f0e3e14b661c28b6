"""Settle, release, heartbeat and the sweeper racing on one reservation.

Each round admits a batch of reservations whose leases run out right now
(give or take a few milliseconds), then fires, for every reservation at once,
a settle, a release, a heartbeat, an expire and a sweep, all concurrently on
separate connections. Every reservation must end in exactly one final state,
the winner's; every loser gets a clear answer (a conflict, a replay, "not
due"); the ledger and the balances must count each reservation once.
"""

from __future__ import annotations

import asyncio
import collections
import random
import uuid

import asyncpg

from llmquota.admission.limiter import Limiter
from llmquota.domain.errors import ReservationConflict
from llmquota.domain.records import FinishRequest
from tests.faults.conftest import count, fault_settings, layer, put

ROUNDS = 20
PER_ROUND = 100  # 20 x 100 = 2,000 reservations, 10,000 racing transitions
CAPACITY = 10_000_000
RESERVED = 100


async def _race_one(limiter: Limiter, reservation_id: uuid.UUID) -> dict[str, object]:
    """Fire all five transitions at one reservation at once; what each got back."""

    async def settle() -> object:
        try:
            s = await limiter.settle(reservation_id, input_tokens=10, output_tokens=20)
        except ReservationConflict as exc:
            return f"conflict: {exc}"
        return "late" if s.late else "settled"

    async def release() -> object:
        try:
            await limiter.release(reservation_id)
        except ReservationConflict as exc:
            return f"conflict: {exc}"
        return "released"

    async def heartbeat() -> object:
        try:
            await limiter.heartbeat(reservation_id)
        except ReservationConflict as exc:
            return f"conflict: {exc}"
        return "extended"

    async def expire() -> object:
        (result,) = await limiter.store.finish([FinishRequest(reservation_id, "expire")])
        return result.status

    async def sweep() -> object:
        return (await limiter.sweep(batch_size=10, max_batches=1)).expired

    moves = [settle, release, heartbeat, expire, sweep]
    random.shuffle(moves)
    answers = await asyncio.gather(*(move() for move in moves))
    return {move.__name__: answer for move, answer in zip(moves, answers, strict=True)}


async def test_racing_transitions_end_in_exactly_one_final_state(
    database_dsn: str, db: asyncpg.Connection
) -> None:
    # Hundreds of transitions queue for 20 connections at once: this test is
    # about races, not outages, so the decision deadline is out of the way.
    limiter = await Limiter.connect(
        database_dsn, fault_settings(pool_max_size=20, decision_deadline_ms=60_000)
    )
    try:
        await _race(limiter, db)
    finally:
        await limiter.close()


async def _race(limiter: Limiter, db: asyncpg.Connection) -> None:
    await put(
        limiter,
        "tenant",
        "acme",
        tokens_per_minute=1,
        token_burst=CAPACITY,
        requests_per_minute=1,
        request_burst=CAPACITY,
    )
    outcomes: collections.Counter[str] = collections.Counter()
    answers_seen: collections.Counter[str] = collections.Counter()
    for _ in range(ROUNDS):
        held = [
            await limiter.admit(tenant="acme", model="m", input_tokens=0, max_tokens=RESERVED)
            for _ in range(PER_ROUND)
        ]
        ids = [r.reservation_id for r in held]
        # Leases that run out while the round is racing (it takes about a second).
        await db.execute(
            """UPDATE reservations
                  SET lease_expires_at = clock_timestamp()
                                         + make_interval(secs => random() - 0.3)
                WHERE reservation_id = ANY ($1)""",
            ids,
        )
        results = await asyncio.gather(*(_race_one(limiter, i) for i in ids))
        rows = {
            row["reservation_id"]: row
            for row in await db.fetch(
                "SELECT reservation_id, state, late FROM reservations "
                "WHERE reservation_id = ANY ($1)",
                ids,
            )
        }
        for reservation_id, answers in zip(ids, results, strict=True):
            row = rows[reservation_id]
            outcomes[row["state"] + ("+late" if row["late"] else "")] += 1
            for move, answer in answers.items():
                answers_seen[f"{move}: {str(answer).split(':')[0]}"] += 1
            # Exactly one winner, the final state is the winner's, and every
            # loser was told so.
            # not_due: the expire ran while the lease was live; conflict: after
            # the reservation was already settled or released.
            assert answers["expire"] in ("expired", "not_due", "conflict")
            if row["state"] == "settled":
                assert answers["settle"] == "settled"
                assert str(answers["release"]).startswith("conflict: reservation is settled")
                assert answers["expire"] in ("not_due", "conflict")
            elif row["state"] == "released":
                assert answers["release"] == "released"
                assert str(answers["settle"]).startswith("conflict: reservation was released")
                assert answers["expire"] in ("not_due", "conflict")
            else:
                assert row["state"] == "expired"
                assert str(answers["release"]).startswith("conflict: reservation is expired")
                # A settle after the expiry still counts, marked late.
                assert answers["settle"] == "late" and row["late"]
    total = ROUNDS * PER_ROUND
    assert sum(outcomes.values()) == total
    assert await count(db, "reservations", "state = 'active'") == 0

    # The ledger: one 'usage' row per settled or expired reservation, one
    # 'late' row per late settle, none for a release, never two of a kind.
    settled, released = outcomes["settled"], outcomes["released"]
    late = outcomes["expired+late"]
    assert await count(db, "usage_ledger", "entry_kind = 'usage'") == settled + late
    assert await count(db, "usage_ledger", "entry_kind = 'late'") == late
    # The balance: every reservation charged 30 tokens exactly once if settled
    # (late or not), nothing if released; requests come back only on release.
    row = await layer(db, "acme")
    assert row["in_flight"] == 0
    expected_tokens = CAPACITY - 30 * (settled + late)
    assert expected_tokens <= row["tokens"] <= expected_tokens + 2
    expected_requests = CAPACITY - (total - released)
    assert expected_requests <= row["requests"] <= expected_requests + 2
    print(f"FIGURE races: {total} reservations, outcomes {dict(outcomes)}")
    print(f"FIGURE races answers: {dict(sorted(answers_seen.items()))}")
