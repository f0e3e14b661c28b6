"""An admission statement past its deadline writes nothing; a given-up one is released.

lq_admit carries the moment its worker stops waiting (on the database's
clock as the worker last saw it) and the ids its admissions get. These tests
drive the three cases by hand: a statement that starts past its deadline, one
that starts in time and is held past it (behind a row lock, as a server
frozen mid-statement would be), and one that committed while its caller gave
up, whose ids the recovery releases.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import asyncpg
import pytest

from llmquota.admission.limiter import Limiter
from llmquota.domain.errors import StoreTimeout
from llmquota.store.deadline import MAX_LAG_CREDIT_SECONDS
from llmquota.store.decisions import admit_arguments
from llmquota.store.sqlfiles import queries
from tests.integration.support import put, raw_layer

BURST = 10_000


async def acme(limiter: Limiter) -> None:
    # Refill of 1 token a minute: nothing the test reserves is refilled away.
    await put(
        limiter,
        "tenant",
        "acme",
        tokens_per_minute=1,
        token_burst=BURST,
        requests_per_minute=1,
        request_burst=100,
    )


async def test_a_statement_that_starts_past_its_deadline_writes_nothing(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await acme(limiter)
    request = limiter.prepare(tenant="acme", model="gpt-4o", input_tokens=10, max_tokens=90)
    # A deadline already behind the database's clock (read first, by this call).
    with pytest.raises(StoreTimeout, match="in time"):
        await limiter.store.admit([request], deadline_seconds=-(MAX_LAG_CREDIT_SECONDS + 0.5))
    assert await db.fetchval("SELECT count(*) FROM reservations") == 0
    row = await raw_layer(db, "tenant", "acme")
    assert (row["tokens"], row["requests"], row["in_flight"]) == (BURST, 100, 0)


async def test_a_statement_held_past_its_deadline_rolls_back(
    limiter: Limiter, db: asyncpg.Connection, database_dsn: str
) -> None:
    """Started in time, then held (behind a row lock here, a frozen server in
    life) until after its deadline: it decides, then rolls everything back."""
    await acme(limiter)
    request = limiter.prepare(tenant="acme", model="gpt-4o", input_tokens=10, max_tokens=90)
    locker, admitter = await asyncpg.connect(database_dsn), await asyncpg.connect(database_dsn)
    try:
        tx = locker.transaction()
        await tx.start()
        await locker.execute("SELECT 1 FROM limit_layers WHERE tenant = 'acme' FOR UPDATE")
        pid = admitter.get_server_pid()
        # Time enough to start (prepare, plan, check the deadline) on a loaded machine.
        deadline = await admitter.fetchval("SELECT clock_timestamp() + interval '2 s'")
        arguments = admit_arguments([request], 1000)
        admit = asyncio.ensure_future(
            admitter.fetch(queries()["admit"], *arguments[:17], deadline, None, *arguments[17:])
        )
        # Until it waits on the lock, and then until the database's clock is past its deadline.
        waited = time.monotonic() + 30
        # (read outside the locker's transaction, which would keep one snapshot of it)
        while not await db.fetchval(
            "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1", pid
        ) or not await db.fetchval("SELECT clock_timestamp() > $1", deadline):
            assert not admit.done(), admit
            assert time.monotonic() < waited, "the admission never waited on the lock"
            await asyncio.sleep(0.05)
        assert not admit.done()  # waiting on the lock, past its deadline
        await tx.rollback()
        with pytest.raises(asyncpg.PostgresError, match="ran past its deadline") as raised:
            await admit
        assert raised.value.sqlstate == "LQ002"
    finally:
        await locker.close()
        await admitter.close()
    assert await db.fetchval("SELECT count(*) FROM reservations") == 0
    row = await raw_layer(db, "tenant", "acme")
    assert (row["tokens"], row["requests"], row["in_flight"]) == (BURST, 100, 0)


async def test_a_statement_in_time_admits_under_the_ids_it_names(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await acme(limiter)
    requests = [
        limiter.prepare(tenant="acme", model="gpt-4o", input_tokens=10, max_tokens=90)
        for _ in range(3)
    ]
    ids = [uuid.uuid4() for _ in requests]
    decisions = await limiter.store.admit(requests, deadline_seconds=5.0, reservation_ids=ids)
    assert [d.reservation_id for d in decisions] == ids
    stored = await db.fetch("SELECT reservation_id FROM reservations ORDER BY created_at")
    assert {row["reservation_id"] for row in stored} == set(ids)


async def test_the_ids_of_a_given_up_statement_are_released_when_the_store_answers(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    """What a caller gave up on but the database committed (its answer lost) is
    given back by the recovery; an id the statement never used costs nothing."""
    await acme(limiter)
    request = limiter.prepare(tenant="acme", model="gpt-4o", input_tokens=10, max_tokens=90)
    committed, never_used = uuid.uuid4(), uuid.uuid4()
    await limiter.store.admit([request], deadline_seconds=5.0, reservation_ids=[committed])
    assert (await raw_layer(db, "tenant", "acme"))["in_flight"] == 1

    limiter.outage.abandon([committed, never_used])
    started = time.monotonic()
    while await db.fetchval("SELECT state FROM reservations") == "active":
        assert time.monotonic() - started < 10, "never released"
        await asyncio.sleep(0.05)
    assert await db.fetchval("SELECT state FROM reservations") == "released"
    row = await raw_layer(db, "tenant", "acme")
    assert (row["tokens"], row["requests"], row["in_flight"]) == (BURST, 100, 0)
    # The unused id stays journaled until its statement could no longer commit
    # (the statement timeout after it was first found missing); the released
    # one is forgotten.
    assert len(limiter.outage.abandoned) == 1
    assert await db.fetchval("SELECT count(*) FROM usage_ledger") == 0
