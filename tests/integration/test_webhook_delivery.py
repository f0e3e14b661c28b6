"""Alert delivery to a real local HTTP receiver: signed, retried, once each.

The receiver is a tiny ASGI app on uvicorn on a loopback socket
(tests/receiver.py); the loop is the real DeliveryLoop with the real httpx
sender. Retries are made due by moving `next_attempt_at` in the database,
never by sleeping through the backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from decimal import Decimal

import asyncpg
import pytest

from llmquota.admin.alerts import AlertService
from llmquota.admin.delivery import DeliveryLimits, DeliveryLoop
from llmquota.admission.limiter import Limiter
from llmquota.api.webhooks import MAX_RESPONSE_BYTES, WebhookSender, check_webhook_target
from llmquota.domain.alerts import retry_delay_seconds
from llmquota.domain.destinations import DestinationRules, parse_networks
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


# The receivers of these tests listen on loopback: an on-premise receiver.
LOOPBACK_ALLOWED = DestinationRules(parse_networks("127.0.0.0/8"))


@pytest.fixture
async def sender() -> AsyncIterator[WebhookSender]:
    made = WebhookSender(LOOPBACK_ALLOWED)
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


def make_loop(
    service: AlertService, sender: WebhookSender, metrics: Metrics, per_destination: int = 10
) -> DeliveryLoop:
    limits = DeliveryLimits(
        batch_size=10, claim_seconds=30, timeout_seconds=5, per_destination=per_destination
    )
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


class FakeDns:
    """A resolver hook: what each name resolves to now, and how often it was asked."""

    def __init__(self, answers: dict[str, list[str]]) -> None:
        self.answers = answers
        self.lookups = 0

    async def __call__(self, host: str, timeout_seconds: float) -> list[str]:
        self.lookups += 1
        return list(self.answers.get(host, []))


async def test_a_name_that_rebinds_to_loopback_after_registration_is_refused_at_delivery(
    service: AlertService, receiver: Receiver, db: asyncpg.Connection
) -> None:
    dns = FakeDns({"hooks.rebind.test": ["93.184.216.34"]})
    url = f"http://hooks.rebind.test:{receiver.port}/hook"
    # At registration the name is public, so it is accepted...
    assert await check_webhook_target(url, DestinationRules(), dns) == url
    await service.put_webhook("hook", url, SECRET, None)
    await fire(service, 1)
    # ...and at delivery it points at this machine: refused, nothing sent.
    dns.answers["hooks.rebind.test"] = ["93.184.216.34", "127.0.0.1"]
    sender = WebhookSender(DestinationRules(), resolve=dns)
    try:
        assert await make_loop(service, sender, Metrics()).run_once() == 1
    finally:
        await sender.close()
    assert receiver.received == []
    error = await db.fetchval("SELECT error FROM alert_delivery_attempts")
    assert error.startswith("refused:") and "127.0.0.1" in error and "loopback" in error


async def test_the_connection_goes_to_the_address_that_was_checked_with_one_lookup(
    service: AlertService, receiver: Receiver, db: asyncpg.Connection
) -> None:
    # No resolver of this machine knows the name: only a connection to the
    # address the check saw can reach the receiver.
    dns = FakeDns({"receiver.pinned.test": ["127.0.0.1"]})
    url = f"http://receiver.pinned.test:{receiver.port}/hook"
    await service.put_webhook("hook", url, SECRET, None)
    ids = await fire(service, 2)
    sender = WebhookSender(LOOPBACK_ALLOWED, resolve=dns)
    try:
        assert await make_loop(service, sender, Metrics()).run_once() == 2
    finally:
        await sender.close()
    assert sorted(receiver.delivered_ids()) == sorted(ids)
    assert {r.host for r in receiver.received} == {f"receiver.pinned.test:{receiver.port}"}
    assert dns.lookups == 2  # one per delivery, none between the check and the connect


async def test_one_slow_receiver_holds_only_its_own_slots(
    service: AlertService, db: asyncpg.Connection
) -> None:
    slow = await Receiver(delay_seconds=3.0).start()
    fast = await Receiver().start()
    sender = WebhookSender(LOOPBACK_ALLOWED)
    try:
        await service.put_webhook("slow", slow.url, SECRET, None)
        await fire(service, 6)  # every webhook without a tenant takes them all
        await service.put_webhook("fast", fast.url, SECRET, None)
        later = await fire(service, 3, threshold="0.9")
        limits = DeliveryLimits(
            batch_size=10,
            claim_seconds=30,
            timeout_seconds=5,
            interval_seconds=0.05,
            per_destination=2,
        )
        loop = DeliveryLoop(service.alerts, sender.send, limits, Metrics(), jitter=lambda: 0.0)
        stop = asyncio.Event()
        running = asyncio.create_task(loop.run(stop))
        started = asyncio.get_running_loop().time()
        most_in_flight = 0
        while not set(later) <= set(fast.delivered_ids()):
            most_in_flight = max(most_in_flight, slow.started_requests - len(slow.received))
            assert asyncio.get_running_loop().time() - started < 10, "fast alerts late"
            await asyncio.sleep(0.02)
        fast_done = asyncio.get_running_loop().time() - started
        stop.set()
        await running
    finally:
        await sender.close()
        await slow.stop()
        await fast.stop()
    # The fast receiver's alerts (fired after the slow one's six) did not wait
    # for the slow one's 3 s answers, which were at most 2 at a time.
    assert fast_done < 2.0
    assert most_in_flight <= 2


async def test_an_answer_is_read_up_to_the_cap_and_the_attempt_has_one_deadline(
    service: AlertService, db: asyncpg.Connection
) -> None:
    sent_bytes = 0
    writers: list[asyncio.StreamWriter] = []

    async def huge(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal sent_bytes
        writers.append(writer)
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 104857600\r\n\r\n")
        with contextlib.suppress(ConnectionError):
            for _ in range(100):
                writer.write(b"x" * 1_048_576)
                await writer.drain()
                sent_bytes += 1_048_576

    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        await reader.readuntil(b"\r\n\r\n")
        with contextlib.suppress(ConnectionError):
            for byte in b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n":
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(0.5)

    servers = [await asyncio.start_server(h, "127.0.0.1", 0) for h in (huge, trickle)]
    ports = [server.sockets[0].getsockname()[1] for server in servers]
    sender = WebhookSender(LOOPBACK_ALLOWED)
    try:
        started = asyncio.get_running_loop().time()
        big = await sender.send(f"http://127.0.0.1:{ports[0]}/", b"{}", {}, 5.0)
        slow = await sender.send(f"http://127.0.0.1:{ports[1]}/", b"{}", {}, 1.5)
        took = asyncio.get_running_loop().time() - started
    finally:
        await sender.close()
        for server in servers:
            server.close()
        # The receivers' connections end with the test, not in a later one's loop.
        for writer in writers:
            writer.transport.abort()
        await asyncio.sleep(0)
    assert big.delivered and big.status == 200
    # The huge body was dropped with the connection after the cap, not read.
    assert sent_bytes < 100 * 1_048_576
    assert MAX_RESPONSE_BYTES == 64 * 1024
    # Each trickled byte came within a read timeout, but the whole answer
    # would take 20 s: the attempt ends at its 1.5 s deadline.
    assert not slow.delivered and "within 1.5 s" in (slow.error or "")
    assert took < 5.0
