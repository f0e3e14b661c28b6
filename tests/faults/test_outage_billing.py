"""Outage usage is billed like any other (issue 20).

What a failure mode admits while PostgreSQL is away is charged, when the
journal is replayed, to every layer it would have touched: the prepaid
balance (which may go below zero: the next admission is 402), the calendar
quotas (in the window the usage happened, by the journal's clock, with the
alerts of the thresholds it crossed, once), and provider ceilings. During
the outage `local` decisions use only a worker-local fraction of each
ceiling, quota remaining and prepaid balance as last known. Each replayed
charge happens once, also through kill -9 of the replaying worker.

The database is reached through the test's proxy (tests/faults/proxy.py):
`pause()` freezes it, `cut()` refuses connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from llmquota.admission.limiter import Limiter
from llmquota.admission.outage import OutageEntry, OutageJournal
from llmquota.api.app import create_app
from llmquota.domain.errors import CreditsExhausted, QuotaExceeded, RateLimited
from llmquota.domain.records import AdmitRequest, FinishRequest
from tests.faults.conftest import Worker, count, fault_settings, serving_process
from tests.faults.proxy import PgProxy
from tests.faults.test_clock import _skewed

ADMIN_KEY = "lq_fault_admin_key_0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
# gpt-4o at $2.50 in and $10 out per million tokens.
PRICE_IN, PRICE_OUT = Decimal("2.50"), Decimal("10.00")


def cost(input_tokens: int, output_tokens: int) -> Decimal:
    return (input_tokens * PRICE_IN + output_tokens * PRICE_OUT) / 1_000_000


async def price(db: asyncpg.Connection) -> None:
    await db.execute(
        """INSERT INTO model_prices (model, effective_from, input_usd_per_million,
                                     output_usd_per_million)
           VALUES ('gpt-4o', '2020-01-01', $1, $2)""",
        PRICE_IN,
        PRICE_OUT,
    )


@contextlib.asynccontextmanager
async def admin_client(dsn: str) -> AsyncIterator[httpx.AsyncClient]:
    """The REST app on the database itself (not the proxy), for the set-up."""
    app = create_app(fault_settings(admin_key=ADMIN_KEY), dsn=dsn)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://llmquota") as client:
            yield client


async def ok(response: Any) -> dict[str, Any]:
    r = await response
    assert r.is_success, r.text
    body: dict[str, Any] = r.json()
    return body


async def tenant(client: httpx.AsyncClient, name: str, **policy: Any) -> None:
    body = {"tokens_per_minute": 10_000_000, **policy}
    await ok(client.put(f"/v1/tenants/{name}/policy", json=body, headers=ADMIN))


async def quota(client: httpx.AsyncClient, name: str, tokens: int) -> None:
    body = {"period": "day", "tokens": tokens}
    await ok(client.put(f"/v1/tenants/{name}/quotas/daily", json=body, headers=ADMIN))


async def top_up(client: httpx.AsyncClient, name: str, amount: str) -> None:
    body = {"amount": amount, "reference": f"inv-{name}"}
    await ok(client.post(f"/v1/tenants/{name}/credits", json=body, headers=ADMIN))


async def balance(db: asyncpg.Connection, name: str) -> Decimal:
    value: Decimal = await db.fetchval(
        "SELECT balance FROM credit_accounts WHERE tenant = $1", name
    )
    return value


async def charges(db: asyncpg.Connection, name: str) -> tuple[int, Decimal]:
    row = await db.fetchrow(
        """SELECT count(*) AS n, coalesce(-sum(amount), 0) AS total FROM credit_ledger
            WHERE tenant = $1 AND entry_kind = 'charge'""",
        name,
    )
    assert row is not None
    return int(row["n"]), row["total"]


async def windows(db: asyncpg.Connection, name: str) -> list[tuple[datetime, int, int]]:
    """(window_start, reserved, charged) of a tenant's quota windows, oldest first."""
    rows = await db.fetch(
        """SELECT window_start, reserved_tokens, charged_tokens FROM quota_windows
            WHERE tenant = $1 ORDER BY window_start""",
        name,
    )
    return [(r["window_start"], r["reserved_tokens"], r["charged_tokens"]) for r in rows]


async def quota_alerts(db: asyncpg.Connection, name: str) -> list[tuple[Decimal, datetime]]:
    rows = await db.fetch(
        """SELECT threshold, window_start FROM alert_outbox
            WHERE tenant = $1 AND event_type = 'quota.threshold' ORDER BY threshold""",
        name,
    )
    return [(r["threshold"], r["window_start"]) for r in rows]


async def wait_until(db: asyncpg.Connection, where: str, n: int, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while await count(db, "reservations", where) < n:
        assert time.monotonic() < deadline, f"fewer than {n} reservations where {where}"
        await asyncio.sleep(0.05)


# What every request of the scenario asks and uses: 1,100 tokens, $0.01025.
SCENARIO_BODY = {"model": "gpt-4o", "input_tokens": 100, "max_tokens": 1_000}
SCENARIO_USAGE = {"input_tokens": 100, "output_tokens": 1_000}


class Gateway:
    """A client of the server under test, speaking with the admin key."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def admit(self, name: str) -> httpx.Response:
        body = {"tenant": name, **SCENARIO_BODY}
        return await self.client.post("/v1/admit", json=body, headers=ADMIN)

    async def settle(self, reservation_id: str) -> httpx.Response:
        url = f"/v1/reservations/{reservation_id}/settle"
        return await self.client.post(url, json=SCENARIO_USAGE, headers=ADMIN)


async def _served_during_a_freeze(gateway: Gateway, proxy: PgProxy) -> float:
    """The outage: 1 local and 99 open admits and their settles; its seconds."""
    proxy.pause()
    frozen = time.perf_counter()
    # local-co: a local share of half of what was left, 1,950 of the 3,900
    # quota tokens (and $0.034875 of $0.06975): one request fits.
    local_first = await gateway.admit("local-co")
    assert local_first.status_code == 201, local_first.text
    assert local_first.headers["llmquota-fallback"] == "local"
    local_refused = await gateway.admit("local-co")
    assert local_refused.status_code == 429, local_refused.text
    assert local_refused.json()["error"]["type"] == "insufficient_quota"
    assert local_refused.json()["error"]["quota"] == "daily"
    # open-co: open is open, 99 at once.
    opened = await asyncio.gather(*(gateway.admit("open-co") for _ in range(99)))
    assert [r.status_code for r in opened] == [201] * 99
    assert {r.headers["llmquota-fallback"] for r in opened} == {"open"}
    ids = [r.json()["reservation_id"] for r in [local_first, *opened]]
    settled = await asyncio.gather(*(gateway.settle(i) for i in ids))
    assert [r.status_code for r in settled] == [200] * 100
    seconds = time.perf_counter() - frozen
    proxy.resume()
    return seconds


async def test_a_frozen_store_bills_outage_usage_to_credits_and_quotas(
    proxy: PgProxy, database_dsn: str, db: asyncpg.Connection, tmp_path: Path
) -> None:
    """The reported scenario, against `uvicorn` as a subprocess over sockets: two
    prepaid tenants (0.08 each, a 5,000-token daily quota), one `open`, one
    `local`; 100 admits and settles during a freeze of the database."""
    await price(db)
    async with admin_client(database_dsn) as admin:
        for name, mode in (("open-co", "open"), ("local-co", "local")):
            await tenant(admin, name, prepaid=True, failure_mode=mode)
            await quota(admin, name, 5_000)
            await top_up(admin, name, "0.08")
        await tenant(admin, "probe")
    each = cost(100, 1_000)
    env = {
        "LLMQUOTA_DECISION_DEADLINE_MS": "250",
        "LLMQUOTA_OUTAGE_LOCAL_FRACTION": "0.5",
        "LLMQUOTA_OUTAGE_PROBE_SECONDS": "0.1",
        "LLMQUOTA_POLICY_CACHE_REFRESH_SECONDS": "0.2",
    }
    async with (
        serving_process(proxy.dsn, ADMIN_KEY, tmp_path / "server.log", **env) as base,
        httpx.AsyncClient(base_url=base, timeout=30) as client,
    ):
        gateway = Gateway(client)
        for name in ("open-co", "local-co"):  # one charge each before the outage
            r = await gateway.admit(name)
            assert r.status_code == 201 and "llmquota-fallback" not in r.headers, r.text
            assert (await gateway.settle(r.json()["reservation_id"])).status_code == 200
        # Let the worker take its snapshot of the balances and quotas after
        # those (it refreshes when the store answered and 0.2 s have passed).
        await asyncio.sleep(0.3)
        assert (await gateway.admit("probe")).is_success
        await asyncio.sleep(0.5)
        freeze_seconds = await _served_during_a_freeze(gateway, proxy)
        await wait_until(db, "outage_mode IS NOT NULL AND state = 'settled'", 100)

        # The next admission: refused by the quota (110,000 of 5,000 used),
        # which admission checks first; with the quota raised, by the balance.
        after = await gateway.admit("open-co")
        assert after.status_code == 429 and after.json()["error"]["quota"] == "daily"
        raised = {"period": "day", "tokens": 1_000_000}
        await ok(client.put("/v1/tenants/open-co/quotas/daily", json=raised, headers=ADMIN))
        after = await gateway.admit("open-co")
        assert after.status_code == 402, after.text
        assert after.json()["error"]["type"] == "credits_exhausted"
        assert (await gateway.admit("local-co")).status_code == 201

    # Exactly 100 charges, one per outage settlement, summing to the usage.
    assert await count(db, "reservations", "outage_mode IS NOT NULL") == 100
    open_charges, local_charges = await charges(db, "open-co"), await charges(db, "local-co")
    assert open_charges == (1 + 99, 100 * each)
    assert local_charges == (1 + 1, 2 * each)
    assert open_charges[1] + local_charges[1] - 2 * each == Decimal("1.025")
    # The balance went below zero by what was used.
    assert await balance(db, "open-co") == Decimal("0.08") - 100 * each == Decimal("-0.945")
    assert await balance(db, "local-co") == Decimal("0.08") - 2 * each
    # The quota windows hold exactly the usage: 110,000 tokens in the outage.
    (open_window,) = await windows(db, "open-co")
    assert open_window[1:] == (0, 100 * 1_100)
    (local_window,) = await windows(db, "local-co")
    assert local_window[1:] == (1_100, 2 * 1_100)  # and the hold of its last admit
    assert await count(db, "usage_ledger", "tenant IN ('open-co', 'local-co')") == 102
    # open-co crossed every threshold: each alert once, in that window;
    # local-co's 2,200 used and 1,100 held pass half of its 5,000.
    assert await quota_alerts(db, "open-co") == [
        (Decimal(t), open_window[0]) for t in ("0.5", "0.8", "0.95", "1.0")
    ]
    assert await quota_alerts(db, "local-co") == [(Decimal("0.5"), local_window[0])]
    print(
        f"FIGURE outage billing: a {freeze_seconds:.1f} s freeze, 100 outage admits and "
        f"settles (99 open, 1 local; local refused past its share), 110,000 tokens: "
        f"{open_charges[0] - 1 + local_charges[0] - 1} credit charges of "
        f"{open_charges[1] + local_charges[1] - 2 * each:.5f}, open-co balance "
        f"{await balance(db, 'open-co'):.5f} (next admit 402), quota window 110,000 of 5,000"
    )


async def test_local_refuses_past_its_share_of_credit_quota_and_ceiling(
    proxy: PgProxy, database_dsn: str, db: asyncpg.Connection
) -> None:
    await price(db)
    async with admin_client(database_dsn) as admin:
        await tenant(admin, "credit-co", prepaid=True, failure_mode="local")
        await top_up(admin, "credit-co", "0.04")
        await tenant(admin, "quota-co", failure_mode="local")
        await quota(admin, "quota-co", 4_000)
        await tenant(admin, "ceil-co", failure_mode="local")
        await tenant(admin, "open-co", failure_mode="open")
        ceiling = {"models": ["big-*"], "tokens_per_minute": 6_000}
        await ok(admin.put("/v1/ceilings/provider", json=ceiling, headers=ADMIN))
    limiter = await Limiter.connect(proxy.dsn, fault_settings(outage_local_fraction=0.5))
    try:
        await limiter.refresh_policies()
        await proxy.cut()

        async def admit(name: str, model: str, input_tokens: int, max_tokens: int) -> Any:
            return await limiter.admit(
                tenant=name, model=model, input_tokens=input_tokens, max_tokens=max_tokens
            )

        # Credits: a share of $0.02 of $0.04; a request holds cost(100, 900) = $0.00925.
        credit = [await admit("credit-co", "gpt-4o", 100, 900) for _ in range(2)]
        with pytest.raises(CreditsExhausted) as short:
            await admit("credit-co", "gpt-4o", 100, 900)
        assert short.value.balance == Decimal("0.02") - 2 * cost(100, 900)
        # A settle keeps only what was used ($0.00125): room for one more.
        await credit[0].settle(input_tokens=100, output_tokens=100)
        credit.append(await admit("credit-co", "gpt-4o", 100, 900))
        with pytest.raises(CreditsExhausted):
            await admit("credit-co", "gpt-4o", 100, 900)

        # Quota: a share of 2,000 of the 4,000 tokens left.
        held = [await admit("quota-co", "m", 0, 1_000) for _ in range(2)]
        with pytest.raises(QuotaExceeded) as over:
            await admit("quota-co", "m", 0, 1_000)
        assert over.value.quota == "daily"

        # Ceiling: a local bucket of 3,000 of its 6,000 tokens; open ignores it.
        capped = [await admit("ceil-co", "big-1", 0, 1_000) for _ in range(3)]
        with pytest.raises(RateLimited) as limited:
            await admit("ceil-co", "big-1", 0, 1_000)
        assert (limited.value.limit, limited.value.scope) == ("tokens", "ceiling")
        opened = [await admit("open-co", "big-1", 0, 1_000) for _ in range(5)]
        uncapped = await admit("ceil-co", "small", 0, 1_000)  # no ceiling covers it

        await proxy.restore()
        deadline = time.monotonic() + 10
        while len(limiter.journal):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        # Recorded on the ceiling: all 8 of its reservations hold a permit and
        # took 8,000 tokens from 6,000 (refill is 100 a second).
        row = await db.fetchrow(
            "SELECT tokens, in_flight FROM limit_layers WHERE scope = 'ceiling'"
        )
        assert row is not None and row["in_flight"] == 8 and row["tokens"] < -1_000
        for r in credit[1:]:
            await r.settle(input_tokens=100, output_tokens=100)
        for r in held:
            await r.settle(input_tokens=0, output_tokens=500)
        for r in [*capped, *opened, uncapped]:
            await r.release()
    finally:
        await limiter.close()
    assert await charges(db, "credit-co") == (3, 3 * cost(100, 100))
    assert await balance(db, "credit-co") == Decimal("0.04") - 3 * cost(100, 100)
    assert [w[1:] for w in await windows(db, "quota-co")] == [(0, 1_000)]


async def test_outage_usage_is_charged_to_the_window_it_happened_in(
    proxy: PgProxy, database_dsn: str, db: asyncpg.Connection
) -> None:
    """A worker whose outage was yesterday (its clock a day behind the
    database's) replays today: the quota of yesterday is charged, with its
    alerts, once, also when the journal is replayed a second time."""
    async with admin_client(database_dsn) as admin:
        await tenant(admin, "late-co", failure_mode="open")
        await quota(admin, "late-co", 1_000)
    midnight = await db.fetchval("SELECT date_trunc('day', clock_timestamp() AT TIME ZONE 'UTC')")
    today = midnight.replace(tzinfo=UTC)
    yesterday = today - timedelta(days=1)
    worker = await Worker.start(
        proxy.dsn,
        LLMQUOTA_DECISION_DEADLINE_MS="1000",
        LLMQUOTA_OUTAGE_PROBE_SECONDS="0.1",
        FAKETIME_DONT_FAKE_MONOTONIC="1",
        **_skewed("-1d"),
    )
    try:
        clock = await worker.call(op="clock")
        assert datetime.fromtimestamp(clock["wall"], UTC) < today
        await proxy.cut()
        result = await worker.call(
            op="admit", tenant="late-co", model="m", input_tokens=10, max_tokens=90, count=10
        )
        ids = [a["reservation_id"] for a in result["admitted"]]
        assert len(ids) == 10
        for reservation_id in ids:
            answer = await worker.call(
                op="settle", reservation_id=reservation_id, input_tokens=10, output_tokens=90
            )
            assert answer == {"charged_tokens": 100, "late": False}
        await proxy.restore()
        await wait_until(db, "outage_mode = 'open' AND state = 'settled'", 10)
    finally:
        await worker.stop()

    expected = [(yesterday, 0, 1_000)]
    assert await windows(db, "late-co") == expected
    alerts = [(Decimal(t), yesterday) for t in ("0.5", "0.8", "0.95", "1.0")]
    assert await quota_alerts(db, "late-co") == alerts
    moments = await db.fetch("SELECT created_at, usage_at FROM reservations")
    assert all(yesterday <= r["created_at"] <= r["usage_at"] < today for r in moments)

    # The same journal replayed again (a lost answer, a spool replayed twice):
    # nothing is charged twice, no alert fires again.
    limiter = await Limiter.connect(database_dsn, fault_settings())
    try:
        duplicate = OutageJournal(max_entries=100)
        for reservation_id in map(uuid.UUID, ids):
            entry = OutageEntry(
                reservation_id=reservation_id,
                request=AdmitRequest("late-co", None, "m", 10, 90, False, None, None, None),
                mode="open",
                policy_version=1,
                admitted_at=yesterday,
            )
            duplicate.add(entry)
            finish = FinishRequest(reservation_id, "settle", None, 10, 90, "ok")
            duplicate.set_finish(entry, finish, yesterday)
        report = await duplicate.flush(limiter.store, batch_size=3, deadline_seconds=5)
        assert (report.admissions_recorded, report.finishes_recorded) == (10, 10)
    finally:
        await limiter.close()
    assert await windows(db, "late-co") == expected
    assert await quota_alerts(db, "late-co") == alerts
    assert await count(db, "usage_ledger") == 10


async def _journal_and_die(proxy: PgProxy, spooled: dict[str, str], n: int) -> None:
    """A worker admits and settles n requests of spool-co during an outage,
    then is killed -9 before any replay: its spool holds everything."""
    first = await Worker.start(proxy.dsn, **spooled)
    try:
        await proxy.cut()
        result = await first.call(
            op="admit", tenant="spool-co", model="gpt-4o", input_tokens=10, max_tokens=90, count=n
        )
        ids = [a["reservation_id"] for a in result["admitted"]]
        assert len(ids) == n
        for i, reservation_id in enumerate(ids):
            await first.call(
                op="settle", reservation_id=reservation_id, input_tokens=10, output_tokens=i % 90
            )
        first.process.kill()
        await first.process.wait()
    finally:
        await first.stop()
    await proxy.restore()


async def test_kill_9_mid_replay_then_adoption_bills_each_charge_once(
    proxy: PgProxy, database_dsn: str, db: asyncpg.Connection, tmp_path: Path
) -> None:
    spool = tmp_path / "spool"
    n = 200
    await price(db)
    async with admin_client(database_dsn) as admin:
        await tenant(admin, "spool-co", prepaid=True, failure_mode="open")
        await quota(admin, "spool-co", 1_000_000)
        await top_up(admin, "spool-co", "10")
    spooled = {"LLMQUOTA_OUTAGE_SPOOL_DIR": str(spool), "LLMQUOTA_DECISION_DEADLINE_MS": "1000"}
    await _journal_and_die(proxy, spooled, n)

    # The second worker adopts the spool and replays it two entries a
    # statement (every admission, then every settle); it is killed -9 once
    # some settles, not all, are in the store, while its next statement hangs
    # (its answer, if it committed, is lost).
    replayer = await Worker.start(
        proxy.dsn,
        LLMQUOTA_OUTAGE_FLUSH_BATCH_SIZE="2",
        LLMQUOTA_OUTAGE_PROBE_SECONDS="0.1",
        **spooled,
    )
    try:
        deadline = time.monotonic() + 30
        while await count(db, "reservations", "outage_mode = 'open' AND state = 'settled'") == 0:
            assert time.monotonic() < deadline, "the replay did not start"
            await asyncio.sleep(0.005)
        proxy.pause()
        replayer.process.kill()
        await replayer.process.wait()
    finally:
        await replayer.stop()
    proxy.resume()
    recorded_at_kill = await count(db, "reservations", "outage_mode = 'open'")
    settled_at_kill = await count(db, "reservations", "outage_mode = 'open' AND state = 'settled'")
    assert 0 < settled_at_kill < n, "the kill was not mid-replay"

    survivor = await Limiter.connect(proxy.dsn, fault_settings(outage_spool_dir=str(spool)))
    try:
        deadline = time.monotonic() + 30
        while len(survivor.journal):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
    finally:
        await survivor.close()
    assert list(spool.glob("spool-*.jsonl")) == []

    used = [(10, i % 90) for i in range(n)]
    total_cost = sum((cost(*u) for u in used), Decimal(0))
    assert await count(db, "reservations", "outage_mode = 'open' AND state = 'settled'") == n
    assert await count(db, "usage_ledger") == n
    assert await charges(db, "spool-co") == (n, total_cost)
    assert await balance(db, "spool-co") == Decimal(10) - total_cost
    assert [w[1:] for w in await windows(db, "spool-co")] == [(0, sum(a + b for a, b in used))]
    print(
        f"FIGURE outage billing: kill -9 of the replaying worker with {recorded_at_kill} of "
        f"{n} admissions and {settled_at_kill} settles in the store; after adoption {n} "
        f"charges of {total_cost:.6f}, each once"
    )
