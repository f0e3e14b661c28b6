"""Crashes: a worker paused past its lease, a worker killed holding 50 leases,
and a connection lost in the middle of a statement."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid

import asyncpg
import pytest

from llmquota.admission.limiter import Limiter
from llmquota.domain.errors import ReservationConflict, StoreUnavailable
from tests.faults.conftest import PYTHON, Worker, count, fault_settings, layer, put, worker_env

LEASE_SECONDS = 2
SWEEP_INTERVAL_SECONDS = 0.5
# Scheduling slack on a shared 2-core machine: a sweep that should happen at
# the deadline may start this much later.
SLACK_SECONDS = 1.0


async def test_paused_worker_cannot_heartbeat_and_its_settle_is_late_and_counted_once(
    limiter: Limiter, database_dsn: str, db: asyncpg.Connection
) -> None:
    await put(limiter, "tenant", "acme", tokens_per_minute=1, token_burst=100_000, max_in_flight=1)
    worker = await Worker.start(database_dsn)
    try:
        held = await worker.call(
            op="admit",
            tenant="acme",
            model="m",
            input_tokens=100,
            max_tokens=900,
            lease_seconds=LEASE_SECONDS,
        )
        reservation_id = held["admitted"][0]["reservation_id"]

        os.kill(worker.pid, signal.SIGSTOP)  # a long GC pause, a frozen VM
        await asyncio.sleep(LEASE_SECONDS + 0.2)
        report = await limiter.sweep()
        assert report.expired == 1
        # The permit is free again and somebody else takes it.
        successor = await limiter.admit(tenant="acme", model="m", input_tokens=1, max_tokens=1)
        os.kill(worker.pid, signal.SIGCONT)

        beat = await worker.call(op="heartbeat", reservation_id=reservation_id)
        assert beat["error"] == "ReservationConflict"
        assert "expired" in beat["message"]
        settled = await worker.call(
            op="settle", reservation_id=reservation_id, input_tokens=100, output_tokens=300
        )
        assert settled == {"charged_tokens": 400, "late": True}
        again = await worker.call(
            op="settle", reservation_id=reservation_id, input_tokens=100, output_tokens=300
        )
        assert again == settled
    finally:
        await worker.stop()
    rows = await db.fetch(
        "SELECT entry_kind, outcome, input_tokens, output_tokens FROM usage_ledger "
        "WHERE reservation_id = $1 ORDER BY entry_kind DESC",
        uuid.UUID(reservation_id),
    )
    assert [tuple(r) for r in rows] == [("usage", "expired", 0, 0), ("late", "late", 100, 300)]
    assert (await layer(db, "acme"))["in_flight"] == 1  # the successor's permit, only
    await successor.release()


async def test_stale_lease_generation_is_fenced_off(limiter: Limiter) -> None:
    await put(limiter, "tenant", "acme", tokens_per_minute=60_000)
    r = await limiter.admit(tenant="acme", model="m", input_tokens=1, max_tokens=1)
    # Generation 1 is what the admission handed out; a takeover heartbeats it to 2.
    taken = await limiter.heartbeat(r.reservation_id, lease_generation=1)
    assert taken.lease_generation == 2
    with pytest.raises(ReservationConflict, match="stale lease generation 1"):
        await limiter.heartbeat(r.reservation_id, lease_generation=1)
    assert (await limiter.heartbeat(r.reservation_id, lease_generation=2)).lease_generation == 3
    await r.settle(input_tokens=1, output_tokens=1)


async def test_killed_worker_leases_are_reclaimed_after_ttl_exactly_once(
    limiter: Limiter, database_dsn: str, db: asyncpg.Connection
) -> None:
    capacity = 100_000
    await put(
        limiter, "tenant", "acme", tokens_per_minute=1, token_burst=capacity, max_in_flight=60
    )
    # The test itself holds 40,000 tokens, so that a double refund could not
    # hide behind the clamp at capacity.
    pinned = await limiter.admit(
        tenant="acme", model="m", input_tokens=0, max_tokens=40_000, lease_seconds=600
    )
    worker = await Worker.start(database_dsn)
    held = await worker.call(
        op="admit",
        tenant="acme",
        model="m",
        input_tokens=100,
        max_tokens=900,
        lease_seconds=LEASE_SECONDS + 1,
        count=50,
    )
    assert len(held["admitted"]) == 50
    worker.process.kill()  # -9: no settle, no release, no goodbye
    await worker.process.wait()
    assert (await layer(db, "acme"))["in_flight"] == 51

    sweeper = await asyncio.create_subprocess_exec(
        PYTHON,
        "-m",
        "llmquota.cli",
        "sweep",
        "--loop",
        str(SWEEP_INTERVAL_SECONDS),
        env=worker_env(LLMQUOTA_DATABASE_URL=database_dsn),
        stdout=asyncio.subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + LEASE_SECONDS + 1 + SWEEP_INTERVAL_SECONDS + 10
        while await count(db, "reservations", "state = 'active'") > 1:
            assert time.monotonic() < deadline, "leases not reclaimed"
            await asyncio.sleep(0.1)
    finally:
        sweeper.send_signal(signal.SIGINT)
        await sweeper.wait()

    timing = await db.fetchrow(
        """SELECT count(*) AS n,
                  min(extract(epoch FROM finished_at - lease_expires_at)) AS earliest,
                  max(extract(epoch FROM finished_at - lease_expires_at)) AS latest
             FROM reservations WHERE state = 'expired'"""
    )
    assert timing["n"] == 50
    print(
        f"FIGURE kill -9: 50 leases reclaimed {timing['earliest']:.3f}s to "
        f"{timing['latest']:.3f}s after their lease ran out (sweep every "
        f"{SWEEP_INTERVAL_SECONDS}s)"
    )
    assert timing["earliest"] >= 0, "a lease was reclaimed before its TTL"
    assert timing["latest"] <= SWEEP_INTERVAL_SECONDS + SLACK_SECONDS
    row = await layer(db, "acme")
    assert row["in_flight"] == 1  # only the pinned reservation's permit
    # Every reserved token came back once: capacity - the pinned 40,000 (plus
    # at most a token of refill at 1 a minute).
    assert capacity - 40_000 <= row["tokens"] <= capacity - 40_000 + 1
    ledger = await db.fetchrow(
        "SELECT count(*) AS n, count(DISTINCT reservation_id) AS distinct_ids, "
        "sum(reserved_tokens) AS held FROM usage_ledger WHERE outcome = 'expired'"
    )
    assert tuple(ledger) == (50, 50, 50 * 1_000)
    await pinned.release()


async def _backend_waiting_on_a_lock(db: asyncpg.Connection) -> int:
    for _ in range(200):
        pid = await db.fetchval(
            """SELECT pid FROM pg_stat_activity
                WHERE datname = current_database() AND application_name = 'llmquota'
                  AND wait_event_type = 'Lock'"""
        )
        if pid is not None:
            return int(pid)
        await asyncio.sleep(0.02)
    raise AssertionError("the statement never blocked on the lock")


async def test_connection_lost_mid_admit_leaves_nothing_and_is_retryable(
    database_dsn: str, db: asyncpg.Connection
) -> None:
    limiter = await Limiter.connect(
        database_dsn, fault_settings(decision_deadline_ms=30_000, lock_timeout_ms=30_000)
    )
    try:
        await put(
            limiter,
            "tenant",
            "acme",
            tokens_per_minute=1,
            token_burst=10_000,
            requests_per_minute=1,
            request_burst=100,
        )
        before = await layer(db, "acme")
        locker = await asyncpg.connect(database_dsn)
        try:
            tx = locker.transaction()
            await tx.start()
            await locker.execute("SELECT 1 FROM limit_layers WHERE tenant = 'acme' FOR UPDATE")
            admit = asyncio.ensure_future(
                limiter.admit(tenant="acme", model="m", input_tokens=10, max_tokens=90)
            )
            pid = await _backend_waiting_on_a_lock(db)
            assert await db.fetchval("SELECT pg_terminate_backend($1)", pid)
            with pytest.raises(StoreUnavailable):
                await admit
            await tx.rollback()
        finally:
            await locker.close()
        assert await count(db, "reservations") == 0
        after = await layer(db, "acme")
        assert (after["tokens"], after["requests"], after["in_flight"]) == (
            before["tokens"],
            before["requests"],
            0,
        )
        # Retryable: the same call now succeeds on a fresh connection.
        r = await limiter.admit(tenant="acme", model="m", input_tokens=10, max_tokens=90)
        assert r.reserved_tokens == 100
        await r.release()
    finally:
        await limiter.close()


async def test_connection_lost_mid_settle_leaves_it_active_and_the_retry_counts_once(
    database_dsn: str, db: asyncpg.Connection
) -> None:
    limiter = await Limiter.connect(
        database_dsn, fault_settings(decision_deadline_ms=30_000, lock_timeout_ms=30_000)
    )
    try:
        await put(limiter, "tenant", "acme", tokens_per_minute=1, token_burst=10_000)
        r = await limiter.admit(tenant="acme", model="m", input_tokens=10, max_tokens=90)
        locker = await asyncpg.connect(database_dsn)
        try:
            tx = locker.transaction()
            await tx.start()
            await locker.execute("SELECT 1 FROM limit_layers WHERE tenant = 'acme' FOR UPDATE")
            settle = asyncio.ensure_future(r.settle(input_tokens=10, output_tokens=20))
            pid = await _backend_waiting_on_a_lock(db)
            assert await db.fetchval("SELECT pg_terminate_backend($1)", pid)
            with pytest.raises(StoreUnavailable):
                await settle
            await tx.rollback()
        finally:
            await locker.close()
        assert await count(db, "usage_ledger") == 0
        assert await count(db, "reservations", "state = 'active'") == 1
        s = await r.settle(input_tokens=10, output_tokens=20)
        assert (s.charged_tokens, s.refunded_tokens, s.late) == (30, 70, False)
        assert await count(db, "usage_ledger") == 1
    finally:
        await limiter.close()
