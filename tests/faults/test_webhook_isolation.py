"""Webhook receivers that misbehave cannot delay another tenant's alerts or
fill the server's memory, and a webhook URL cannot reach what it must not.

The server is the real app under uvicorn in its own process; the hostile
receivers are processes of their own (tests/hostile_receiver.py): one
trickles its answer a byte every 4 s, one answers 200 with a 300 MB body.
The well-behaved receiver is tests/receiver.py on a loopback socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import asyncpg
import httpx
import pytest

from llmquota.admin.alerts import AlertService
from llmquota.admission.limiter import Limiter
from tests.faults.conftest import port_of_process, served_process, wait_for
from tests.receiver import Receiver

ADMIN_KEY = "lq_webhook_isolation_admin_0123"
SECRET = "whsec_isolation_0123456789"
QUIET_ALERTS = 4
HOSTILE_ALERTS = 4
# What the promise allows: another webhook's alert arrives within this long of
# being fired, and the server grows by less than this whatever receivers send.
ARRIVAL_BOUND_SECONDS = 2.0
RSS_GROWTH_BOUND_BYTES = 100 * 1024 * 1024


@contextlib.asynccontextmanager
async def hostile_receiver(mode: str) -> AsyncIterator[int]:
    """A tests/hostile_receiver.py process; its port."""
    async with port_of_process("tests.hostile_receiver", mode) as port:
        yield port


def rss_bytes(pid: int) -> int:
    """Resident set size of a process and its children (uvicorn's workers), from /proc."""
    total = 0
    pids = [pid]
    with contextlib.suppress(OSError):
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        pids.extend(int(child) for child in children)
    for one in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{one}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
    return total


async def fire(service: AlertService, tenant: str, n: int) -> dict[str, float]:
    """Fire n alerts of `tenant`; event id -> when it was fired (monotonic)."""
    fired = {}
    for i in range(n):
        event_id = await service.alerts.fire_alert(
            "quota.threshold",
            tenant,
            f"quota:{tenant}:*:q{i}:tokens",
            threshold=Decimal("0.8"),
            window_start=datetime(2026, 3, 1, tzinfo=UTC),
            window_end=datetime(2026, 4, 1, tzinfo=UTC),
            usage=Decimal(800),
            limit=Decimal(1000),
        )
        fired[str(event_id)] = time.monotonic()
    return fired


@pytest.mark.slow
async def test_a_trickling_and_a_huge_receiver_delay_no_other_alert_and_cost_no_memory(
    limiter: Limiter, database_dsn: str, db: asyncpg.Connection, tmp_path: Path
) -> None:
    await db.execute("INSERT INTO tenants (tenant) VALUES ('slow'), ('huge'), ('quiet')")
    service = AlertService(limiter.store)
    quiet = await Receiver().start()
    arrived: dict[str, float] = {}
    try:
        async with (
            hostile_receiver("trickle") as trickle_port,
            hostile_receiver("huge") as huge_port,
            served_process(
                database_dsn,
                ADMIN_KEY,
                tmp_path / "server.log",
                LLMQUOTA_WEBHOOK_ALLOWED_NETWORKS="127.0.0.0/8",
                LLMQUOTA_ALERT_DELIVERY_INTERVAL_SECONDS="0.1",
                LLMQUOTA_ALERT_DELIVERY_TIMEOUT_SECONDS="10",
            ) as (base, pid),
            httpx.AsyncClient(base_url=base, timeout=30) as client,
        ):
            admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
            for name, url, tenant in [
                ("trickle", f"http://127.0.0.1:{trickle_port}/hook", "slow"),
                ("huge", f"http://127.0.0.1:{huge_port}/hook", "huge"),
                ("quiet", quiet.url, "quiet"),
            ]:
                body = {"url": url, "secret": SECRET, "tenant": tenant}
                response = await client.put(f"/v1/webhooks/{name}", json=body, headers=admin)
                assert response.status_code == 201, response.text
            rss_before = rss_bytes(pid)
            assert rss_before > 0
            # The hostile receivers get their alerts first and hold their sends.
            await fire(service, "slow", HOSTILE_ALERTS)
            await fire(service, "huge", HOSTILE_ALERTS)
            await asyncio.sleep(1.5)
            fired = await fire(service, "quiet", QUIET_ALERTS)
            peak_rss = rss_before

            async def quiet_all_arrived() -> bool:
                nonlocal peak_rss
                peak_rss = max(peak_rss, rss_bytes(pid))
                for event_id in quiet.delivered_ids():
                    arrived.setdefault(event_id, time.monotonic())
                return set(fired) <= set(arrived)

            await wait_for(quiet_all_arrived, 30)

            # Watch memory until the trickling receiver's attempts have met
            # their deadline (its whole answer would take 150 s).
            async def trickle_recorded() -> bool:
                nonlocal peak_rss
                peak_rss = max(peak_rss, rss_bytes(pid))
                found = await db.fetchval(
                    "SELECT count(*) FROM alert_delivery_attempts WHERE webhook = 'trickle'"
                )
                return int(found) >= 1

            await wait_for(trickle_recorded, 30)
            attempts = await db.fetch(
                "SELECT a.webhook, a.duration_ms FROM alert_delivery_attempts AS a"
                " WHERE a.webhook IN ('trickle', 'huge')"
            )
    finally:
        await quiet.stop()

    lateness = {event_id: arrived[event_id] - at for event_id, at in fired.items()}
    assert max(lateness.values()) < ARRIVAL_BOUND_SECONDS, lateness
    assert peak_rss - rss_before < RSS_GROWTH_BOUND_BYTES, (rss_before, peak_rss)
    # The hostile sends really happened, and none outlived the attempt deadline.
    assert {row["webhook"] for row in attempts} == {"trickle", "huge"}
    trickled = [row["duration_ms"] for row in attempts if row["webhook"] == "trickle"]
    assert all(9_500 <= ms <= 11_000 for ms in trickled), trickled
    print(
        f"quiet alerts late by at most {max(lateness.values()):.3f} s;"
        f" rss {rss_before / 2**20:.0f} -> peak {peak_rss / 2**20:.0f} MiB;"
        f" trickle attempts {trickled} ms"
    )


async def test_every_spelling_of_a_forbidden_address_is_refused_at_registration(
    limiter: Limiter, database_dsn: str, tmp_path: Path
) -> None:
    async with (
        served_process(database_dsn, ADMIN_KEY, tmp_path / "server.log") as (base, _pid),
        httpx.AsyncClient(base_url=base, timeout=30) as client,
    ):
        port = int(base.rsplit(":", 1)[1])
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        refused = {
            f"http://[::ffff:127.0.0.1]:{port}/v1/admit": "loopback",
            f"http://[::127.0.0.1]:{port}/": "loopback",
            f"http://localhost.:{port}/": "loopback",
            f"http://LOCALHOST:{port}/": "loopback",
            "http://[64:ff9b::a9fe:a9fe]/": "link-local",
            "http://[::169.254.169.254]/": "link-local",
            "http://169.254.169.254/latest/meta-data/": "link-local",
            "http://10.0.0.7/hook": "private",
            "http://[fd12:3456::1]/hook": "private",
            "http://[2002:7f00:1::]/hook": "loopback",
            "http://0.0.0.0:9/": "unspecified",
            "http://[::]:9/": "unspecified",
            "http://224.0.0.1/": "multicast",
        }
        answers = {}
        for url in refused:
            body = {"url": url, "secret": SECRET}
            answers[url] = await client.put("/v1/webhooks/w", json=body, headers=admin)
        public = await client.put(
            "/v1/webhooks/public",
            json={"url": "https://93.184.216.34/hook", "secret": SECRET},
            headers=admin,
        )
        listed = (await client.get("/v1/webhooks", headers=admin)).json()["webhooks"]
    for url, rule in refused.items():
        assert answers[url].status_code == 422, (url, answers[url].text)
        assert rule in answers[url].json()["error"]["message"], (url, answers[url].text)
    assert public.status_code == 201, public.text
    assert [hook["name"] for hook in listed] == ["public"]


async def test_the_allow_list_opens_private_receivers_but_never_the_service_itself(
    limiter: Limiter, database_dsn: str, tmp_path: Path
) -> None:
    async with (
        served_process(
            database_dsn,
            ADMIN_KEY,
            tmp_path / "server.log",
            LLMQUOTA_WEBHOOK_ALLOWED_NETWORKS="127.0.0.0/8, 10.0.0.0/8",
        ) as (base, _pid),
        httpx.AsyncClient(base_url=base, timeout=30) as client,
    ):
        port = int(base.rsplit(":", 1)[1])
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}

        async def put(url: str) -> httpx.Response:
            body = {"url": url, "secret": SECRET}
            return await client.put("/v1/webhooks/w", json=body, headers=admin)

        assert (await put("http://127.0.0.1:9/hook")).status_code == 201
        assert (await put("http://10.0.0.7/hook")).status_code == 200
        for own in (
            f"http://127.0.0.1:{port}/v1/admit",
            f"http://[::ffff:127.0.0.1]:{port}/v1/admit",
            f"http://localhost.:{port}/v1/admit",
        ):
            answer = await put(own)
            assert answer.status_code == 422, (own, answer.text)
            assert "own listening address" in answer.json()["error"]["message"]
        metadata = await put("http://169.254.169.254/")
        assert metadata.status_code == 422
        assert "link-local" in metadata.json()["error"]["message"]
