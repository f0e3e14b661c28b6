"""Ceiling alerts from real worker processes: two detecting at once, and kill -9 mid-delivery.

The workers are the real `llmquota sweep --loop` (which runs the ceiling
alert detector and the delivery loop beside the sweeper, as every `serve`
worker does), connected as the service's role; the receiver is a real
loopback HTTP server (tests/receiver.py). The utilization is driven by real
admissions of a Limiter in the test. Refill is one token a minute.
"""

from __future__ import annotations

import asyncio
import collections
import os
import signal
from pathlib import Path

import asyncpg

from llmquota.admin.alerts import AlertService
from llmquota.admin.service import AdminService
from llmquota.admission.limiter import Limiter
from llmquota.domain.plans import Ceiling
from llmquota.domain.policy import Policy
from tests.faults.conftest import PYTHON, count, wait_for, worker_env
from tests.receiver import Receiver

SECRET = "whsec_ceiling_workers_0123"
BURST = 10_000
THRESHOLDS = ["0.5", "0.8", "0.95"]
CEILING_ALERTS = "event_type = 'ceiling.utilization'"


async def _start_worker(dsn: str, log: Path, **env: str) -> asyncio.subprocess.Process:
    environment = worker_env(
        LLMQUOTA_DATABASE_URL=dsn,
        LLMQUOTA_CEILING_ALERT_INTERVAL_SECONDS="0.05",
        LLMQUOTA_ALERT_DELIVERY_CLAIM_SECONDS="3",
        LLMQUOTA_ALERT_DELIVERY_TIMEOUT_SECONDS="2",
        LLMQUOTA_ALERT_DELIVERY_INTERVAL_SECONDS="0.05",
        # The receiver listens on loopback: an on-premise receiver.
        LLMQUOTA_WEBHOOK_ALLOWED_NETWORKS="127.0.0.0/8",
        **env,
    )
    with log.open("ab") as out:
        return await asyncio.create_subprocess_exec(
            PYTHON,
            "-m",
            "llmquota.cli",
            "sweep",
            "--loop",
            "5",
            stdout=out,
            stderr=out,
            env=environment,
        )


async def _stop(process: asyncio.subprocess.Process) -> None:
    if process.returncode is None:
        process.send_signal(signal.SIGTERM)
        await process.wait()


async def _setup(limiter: Limiter, receiver: Receiver) -> None:
    """A 10,000-token ceiling on gpt-4o alerting at 50, 80 and 95 %, a tenant it
    alone limits, and a webhook to the receiver."""
    admin = AdminService(limiter.store)
    ceiling = Ceiling(
        models=["gpt-4o"], tokens_per_minute=1, token_burst=BURST, alert_at=[0.5, 0.8, 0.95]
    )
    await admin.put_ceiling("org-4o", ceiling)
    await limiter.store.put_policy("tenant", "acme", None, Policy(tokens_per_minute=10**9))
    await AlertService(limiter.store).put_webhook("ops", receiver.url, SECRET, None)


async def _take(limiter: Limiter, tokens: int) -> None:
    await limiter.admit(tenant="acme", model="gpt-4o", input_tokens=0, max_tokens=tokens)


async def test_two_worker_processes_detecting_at_once_record_each_crossing_once(
    limiter: Limiter, app_dsn: str, db: asyncpg.Connection, tmp_path: Path
) -> None:
    receiver = await Receiver().start()
    workers = []
    try:
        await _setup(limiter, receiver)
        workers = [await _start_worker(app_dsn, tmp_path / f"w{n}.log") for n in range(2)]

        async def both_detecting() -> bool:
            # Each worker is in its loop (its first sweep printed; the detector
            # started beside it), and the state rows exist.
            running = all(
                "swept:" in (tmp_path / f"w{n}.log").read_text(errors="replace") for n in range(2)
            )
            return running and await count(db, "ceiling_alert_episodes") == len(THRESHOLDS)

        await wait_for(both_detecting, 60)
        for tokens, crossed in ((6_000, 1), (2_500, 2), (1_100, 3)):  # 60, 85, 96 %
            await _take(limiter, tokens)

            async def recorded(n: int = crossed) -> bool:
                return await count(db, "alert_outbox", CEILING_ALERTS) >= n

            await wait_for(recorded, 30)
            # Both workers sample it many more times: nothing more is recorded.
            await asyncio.sleep(0.5)
            assert await count(db, "alert_outbox", CEILING_ALERTS) == crossed

        async def all_delivered() -> bool:
            return await count(db, "alert_deliveries", "delivered_at IS NOT NULL") == 3

        await wait_for(all_delivered, 30)
        for worker in workers:
            assert worker.returncode is None  # both alive all along
    finally:
        for worker in workers:
            await _stop(worker)
        await receiver.stop()

    thresholds = await db.fetch(
        f"SELECT threshold::text FROM alert_outbox WHERE {CEILING_ALERTS} ORDER BY threshold"
    )
    assert [r["threshold"] for r in thresholds] == THRESHOLDS
    events = [r.json() for r in receiver.delivered()]
    assert sorted(e["threshold"] for e in events) == THRESHOLDS
    assert len(receiver.delivered_ids()) == len(set(receiver.delivered_ids())) == 3
    assert receiver.all_signed(SECRET)


async def test_kill_9_of_the_delivering_worker_then_restart_delivers_each_alert_once(
    limiter: Limiter, app_dsn: str, db: asyncpg.Connection, tmp_path: Path
) -> None:
    # The receiver holds each POST a moment, and one delivery at a time goes
    # out: the kill lands while one is in flight, after another arrived.
    receiver = await Receiver(delay_seconds=0.4).start()
    log = tmp_path / "worker.log"
    one_at_a_time = {"LLMQUOTA_ALERT_DELIVERY_PER_DESTINATION": "1"}
    try:
        await _setup(limiter, receiver)
        first = await _start_worker(app_dsn, log, **one_at_a_time)
        await _take(limiter, 9_600)  # 96 %: past all three in one sample

        async def mid_delivery() -> bool:
            return receiver.started_requests > len(receiver.received) >= 1

        await wait_for(mid_delivery, 60)
        os.kill(first.pid, signal.SIGKILL)
        await first.wait()
        in_flight_at_kill = receiver.started_requests - len(receiver.received)
        assert in_flight_at_kill == 1
        # The episode state survived with the outbox: one alert per threshold.
        assert await count(db, "alert_outbox", CEILING_ALERTS) == 3

        second = await _start_worker(app_dsn, log, **one_at_a_time)
        try:

            async def all_delivered() -> bool:
                return await count(db, "alert_deliveries", "delivered_at IS NOT NULL") == 3

            await wait_for(all_delivered, 60)
            # The restarted worker samples the same episodes: it records none anew.
            await asyncio.sleep(0.5)
            assert await count(db, "alert_outbox", CEILING_ALERTS) == 3
        finally:
            await _stop(second)
    finally:
        await receiver.stop()

    ids = {str(r["event_id"]) for r in await db.fetch("SELECT event_id FROM alert_outbox")}
    arrivals = collections.Counter(receiver.delivered_ids())
    assert set(arrivals) == ids  # every alert arrived
    # At most the one in flight at the kill arrived twice, with the same id:
    # a receiver that drops a repeated id has each alert exactly once.
    assert max(arrivals.values()) <= 2
    assert sum(n - 1 for n in arrivals.values()) <= in_flight_at_kill
    by_id = {r.event_id: r.json() for r in receiver.delivered()}
    assert sorted(body["threshold"] for body in by_id.values()) == THRESHOLDS
    assert receiver.all_signed(SECRET)
