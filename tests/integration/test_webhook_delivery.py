"""Alert delivery to a real local HTTP receiver: signed, retried, once each.

The receiver is a tiny ASGI app on uvicorn on a loopback socket
(tests/receiver.py); the loop is the real DeliveryLoop with the real httpx
sender. Retries are made due by moving `next_attempt_at` in the database,
never by sleeping through the backoff.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from decimal import Decimal

import asyncpg
import pytest

from llmquota.admin.alerts import AlertService
from llmquota.admin.delivery import DeliveryLimits, DeliveryLoop
from llmquota.admission.limiter import Limiter
from llmquota.api.webhooks import WebhookSender
from llmquota.domain.alerts import retry_delay_seconds
from llmquota.metrics import Metrics
from tests.integration.support import count
from tests.receiver import Receiver

SECRET = "whsec_0123456789abcdef"
START, END = datetime(2026, 3, 1, tzinfo=UTC), datetime(2026, 4, 1, tzinfo=UTC)


@pytest.fixture
async def service(limiter: Limiter, db: asyncpg.Connection) -> AlertService:
    await db.execute("INSERT INTO tenants (tenant) VALUES ('acme')")
    return AlertService(limiter.store)


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    started = await Receiver().start()
    yield started
    await started.stop()


@pytest.fixture
async def sender() -> AsyncIterator[WebhookSender]:
    made = WebhookSender()
    yield made
    await made.close()


async def fire(service: AlertService, n: int, threshold: str = "0.8") -> list[str]:
    ids = []
    for i in range(n):
        event_id = await service.alerts.fire_alert(
            "quota.threshold",
            "acme",
            f"quota:acme:*:q{i}:tokens",
            threshold=Decimal(threshold),
            window_start=START,
            window_end=END,
            usage=Decimal(800 + i),
            limit=Decimal(1000),
            projected_exhaustion_at=datetime(2026, 3, 20, tzinfo=UTC),
            payload={"quota": f"q{i}", "unit": "tokens"},
        )
        assert event_id is not None
        ids.append(str(event_id))
    return ids


def make_loop(service: AlertService, sender: WebhookSender, metrics: Metrics) -> DeliveryLoop:
    limits = DeliveryLimits(batch_size=10, claim_seconds=30, timeout_seconds=5)
    return DeliveryLoop(service.alerts, sender.send, limits, metrics, jitter=lambda: 0.0)


async def make_due(db: asyncpg.Connection) -> None:
    """Skip the backoff: every pending delivery is due now."""
    await db.execute(
        "UPDATE alert_deliveries SET next_attempt_at = clock_timestamp()"
        " WHERE delivered_at IS NULL AND gave_up_at IS NULL"
    )


async def test_alerts_reach_a_real_receiver_signed_with_every_field(
    service: AlertService, receiver: Receiver, sender: WebhookSender, db: asyncpg.Connection
) -> None:
    await service.put_webhook("hook", receiver.url, SECRET, None)
    ids = await fire(service, 3)
    metrics = Metrics()
    assert await make_loop(service, sender, metrics).run_once() == 3
    assert sorted(receiver.delivered_ids()) == sorted(ids)
    assert receiver.all_signed(SECRET)
    assert not receiver.all_signed("another_secret_of_16")
    body = next(r.json() for r in receiver.received if r.event_id == ids[0])
    assert body == {
        "id": ids[0],
        "type": "quota.threshold",
        "tenant": "acme",
        "quota": "q0",
        "route": None,
        "unit": "tokens",
        "threshold": "0.8",
        "usage": "800",
        "limit": "1000",
        "window_start": START.isoformat(),
        "window_end": END.isoformat(),
        "projected_exhaustion_at": datetime(2026, 3, 20, tzinfo=UTC).isoformat(),
    }
    assert await count(db, "alert_deliveries", "delivered_at IS NOT NULL") == 3
    assert await count(db, "alert_delivery_attempts", "status = 200") == 3
    assert metrics.alerts.labels("quota.threshold", "delivered")._value.get() == 3
    # Nothing is due any more: a second run sends nothing.
    assert await make_loop(service, sender, metrics).run_once() == 0
    listed = await service.list_alerts("acme")
    assert {a.delivered for a in listed} == {1}


async def test_a_receiver_failing_then_down_then_back_gets_every_alert_once(
    service: AlertService, receiver: Receiver, sender: WebhookSender, db: asyncpg.Connection
) -> None:
    await service.put_webhook("hook", receiver.url, SECRET, "acme")
    ids = await fire(service, 5)
    loop = make_loop(service, sender, Metrics())
    receiver.status = 500
    assert await loop.run_once() == 5
    await make_due(db)
    assert await loop.run_once() == 5
    await receiver.stop()  # down: connections refused
    await make_due(db)
    assert await loop.run_once() == 5
    assert await count(db, "alert_deliveries", "attempts = 3 AND delivered_at IS NULL") == 5
    errors = await db.fetch("SELECT DISTINCT status, error FROM alert_delivery_attempts")
    assert {r["status"] for r in errors} == {500, None}
    assert any("ConnectError" in (r["error"] or "") for r in errors)

    receiver.status = 200
    await receiver.start()  # back, on the same port
    await make_due(db)
    assert await loop.run_once() == 5
    assert sorted(receiver.delivered_ids()) == sorted(ids)  # once each
    await make_due(db)
    assert await loop.run_once() == 0
    assert await count(db, "alert_delivery_attempts") == 20


async def test_two_loops_at_once_never_send_one_delivery_twice(
    service: AlertService, receiver: Receiver, sender: WebhookSender
) -> None:
    await service.put_webhook("hook", receiver.url, SECRET, None)
    ids = await fire(service, 30)
    receiver.delay_seconds = 0.05
    loops = [make_loop(service, sender, Metrics()) for _ in range(3)]
    while len(receiver.delivered_ids()) < 30:
        claimed = await asyncio.gather(*(loop.run_once() for loop in loops))
        assert sum(claimed) > 0
    assert sorted(receiver.delivered_ids()) == sorted(ids)


async def test_a_failed_delivery_waits_with_backoff_and_gives_up_after_a_day(
    service: AlertService, receiver: Receiver, sender: WebhookSender, db: asyncpg.Connection
) -> None:
    await service.put_webhook("hook", receiver.url, SECRET, None)
    await fire(service, 1)
    receiver.status = 503
    await make_loop(service, sender, Metrics()).run_once()
    wait = await db.fetchval(
        "SELECT extract(epoch FROM next_attempt_at - last_attempt_at) FROM alert_deliveries"
    )
    assert 2.0 <= float(wait) <= 6.0  # the first retry: 5 s, halved at most by the jitter
    # A delivery a day old is given up at its next failure.
    await db.execute(
        "UPDATE alert_deliveries SET created_at = created_at - interval '1 day',"
        " next_attempt_at = clock_timestamp()"
    )
    await make_loop(service, sender, Metrics()).run_once()
    assert await count(db, "alert_deliveries", "gave_up_at IS NOT NULL") == 1
    assert await make_loop(service, sender, Metrics()).run_once() == 0


def test_retry_delays_double_with_jitter_up_to_an_hour_and_stop_after_a_day() -> None:
    assert retry_delay_seconds(1, 0, 0.0) == 2.5
    assert retry_delay_seconds(1, 0, 0.999) == pytest.approx(5.0, abs=0.01)
    assert retry_delay_seconds(4, 0, 0.999) == pytest.approx(40.0, abs=0.1)
    assert retry_delay_seconds(30, 0, 0.999) == pytest.approx(3600.0, abs=5)
    assert retry_delay_seconds(30, 86_000, 0.999) == pytest.approx(400.0)
    assert retry_delay_seconds(30, 86_399.5, 0.5) is None
