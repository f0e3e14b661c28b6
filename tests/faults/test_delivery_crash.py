"""kill -9 of the process running the alert delivery loop, mid-delivery.

The real `llmquota sweep --loop` (which runs the delivery loop beside the
sweeper) delivers to a real receiver that holds each request a moment; it
is killed with SIGKILL while POSTs are in flight, and started again. Every
event must arrive, and an event may arrive a second time only if it was in
flight at the kill (sent, not recorded): the receiver drops it by its id.
"""

from __future__ import annotations

import asyncio
import collections
import os
import signal
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import asyncpg

from llmquota.admin.alerts import AlertService
from llmquota.admission.limiter import Limiter
from tests.faults.conftest import PYTHON, count, wait_for, worker_env
from tests.receiver import Receiver

SECRET = "whsec_crash_0123456789"
EVENTS = 12
BATCH = 3


async def _start_loop(dsn: str, log: Path) -> asyncio.subprocess.Process:
    env = worker_env(
        LLMQUOTA_DATABASE_URL=dsn,
        LLMQUOTA_ALERT_DELIVERY_BATCH_SIZE=str(BATCH),
        LLMQUOTA_ALERT_DELIVERY_CLAIM_SECONDS="3",
        LLMQUOTA_ALERT_DELIVERY_TIMEOUT_SECONDS="2",
        LLMQUOTA_ALERT_DELIVERY_INTERVAL_SECONDS="0.1",
        LLMQUOTA_ALERT_DELIVERY_PER_DESTINATION=str(BATCH),
        # The receiver listens on loopback: an on-premise receiver.
        LLMQUOTA_WEBHOOK_ALLOWED_NETWORKS="127.0.0.0/8",
    )
    with log.open("ab") as out:
        return await asyncio.create_subprocess_exec(
            PYTHON, "-m", "llmquota.cli", "sweep", "--loop", "5", stdout=out, stderr=out, env=env
        )


async def test_kill_9_mid_delivery_then_restart_delivers_every_event(
    limiter: Limiter, database_dsn: str, db: asyncpg.Connection, tmp_path: Path
) -> None:
    await db.execute("INSERT INTO tenants (tenant) VALUES ('acme')")
    service = AlertService(limiter.store)
    receiver = await Receiver(delay_seconds=0.4).start()
    try:
        await service.put_webhook("hook", receiver.url, SECRET, None)
        ids = set()
        for i in range(EVENTS):
            event_id = await service.alerts.fire_alert(
                "quota.threshold",
                "acme",
                f"quota:acme:*:q{i}:tokens",
                threshold=Decimal("0.8"),
                window_start=datetime(2026, 3, 1, tzinfo=UTC),
                window_end=datetime(2026, 4, 1, tzinfo=UTC),
                usage=Decimal(800),
                limit=Decimal(1000),
            )
            ids.add(str(event_id))

        first = await _start_loop(database_dsn, tmp_path / "loop.log")

        async def mid_delivery() -> bool:
            # Some delivered, and a batch in flight right now.
            return (
                receiver.started_requests > len(receiver.received)
                and len(receiver.received) >= BATCH
            )

        await wait_for(mid_delivery, 60)
        os.kill(first.pid, signal.SIGKILL)
        await first.wait()
        in_flight_at_kill = receiver.started_requests - len(receiver.received)
        assert in_flight_at_kill >= 1

        second = await _start_loop(database_dsn, tmp_path / "loop.log")
        try:

            async def all_delivered() -> bool:
                return await count(db, "alert_deliveries", "delivered_at IS NOT NULL") == EVENTS

            await wait_for(all_delivered, 90)
        finally:
            second.send_signal(signal.SIGTERM)
            await second.wait()
    finally:
        await receiver.stop()

    arrivals = collections.Counter(receiver.delivered_ids())
    assert set(arrivals) == ids  # every event arrived
    assert max(arrivals.values()) <= 2  # at most one extra by id
    repeats = sum(n - 1 for n in arrivals.values())
    assert repeats <= BATCH  # only what the killed loop had in flight
    assert receiver.all_signed(SECRET)
