"""Store outages: the failure modes, the deadline, recovery, nothing lost.

The database is reached through a proxy the test controls: `pause()` drops
packets (a hang: nothing is refused, nothing answers), `cut()` refuses
connections. The limiter under test is never restarted.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import httpx
import pytest

from llmquota.admission.limiter import Limiter
from llmquota.admission.outage import OutageEntry, OutageJournal
from llmquota.api.app import create_app
from llmquota.domain.errors import RateLimited, ReservationNotFound, StoreUnavailable
from llmquota.domain.outage_ids import is_outage_id, new_outage_id
from llmquota.domain.output_estimates import LearnedEstimate
from llmquota.domain.records import AdmitRequest
from tests.faults.conftest import Worker, count, fault_settings, layer, put
from tests.faults.proxy import PgProxy

ADMIN_KEY = "lq_fault_admin_key_0123456789"
DEADLINE_MS = 250
# The bound a hung decision must answer within: the deadline plus scheduling
# slack on a shared 2-core machine (an order of magnitude below a hang).
ANSWER_BOUND_SECONDS = DEADLINE_MS / 1000 + 0.5


async def wait_until_recorded(limiter: Limiter, timeout_seconds: float = 10.0) -> None:
    """Wait for the limiter's own recovery to empty its outage journal."""
    deadline = time.monotonic() + timeout_seconds
    while len(limiter.journal):
        assert time.monotonic() < deadline, f"{len(limiter.journal)} entries still pending"
        await asyncio.sleep(0.05)


async def admit_once_healthy(client: httpx.AsyncClient) -> httpx.Response:
    """POST /v1/admit until it is decided by the store (a busy machine may
    time one attempt out); at most 5 s. Only to set a test up, never to
    prove a promise."""
    deadline = time.monotonic() + 5
    while True:
        r = await client.post("/v1/admit", json=BODY, headers=ADMIN)
        if r.status_code != 503 or time.monotonic() > deadline:
            return r
        await asyncio.sleep(0.1)


async def wait_until_store_answers(client: httpx.AsyncClient, seconds: float = 5.0) -> float:
    """Poll GET /healthz (one database round trip, no decision) until it is 200;
    the seconds that took."""
    started = time.monotonic()
    while (await client.get("/healthz")).status_code != 200:
        assert time.monotonic() - started < seconds, "the store did not come back"
        await asyncio.sleep(0.05)
    return time.monotonic() - started


def metric(limiter: Limiter, name: str, **labels: str) -> float:
    value = limiter.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


@pytest.fixture
async def app_client(
    proxy: PgProxy, database_dsn: str
) -> AsyncIterator[tuple[httpx.AsyncClient, Limiter]]:
    """The REST app on the proxied database, with a tenant key for acme."""
    settings = fault_settings(admin_key=ADMIN_KEY, decision_deadline_ms=DEADLINE_MS)
    app = create_app(settings, dsn=proxy.dsn)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://llmquota") as client:
            yield client, app.state.limiter


ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
BODY = {"tenant": "acme", "model": "gpt-4o", "input_tokens": 50, "max_tokens": 50}


async def test_closed_mode_hang_answers_503_within_deadline_and_recovers(
    app_client: tuple[httpx.AsyncClient, Limiter], proxy: PgProxy, db: asyncpg.Connection
) -> None:
    client, limiter = app_client
    r = await client.put(
        "/v1/tenants/acme/policy", json={"tokens_per_minute": 60_000}, headers=ADMIN
    )
    assert r.status_code == 200 and r.json()["failure_mode"] == "closed"
    await limiter.refresh_policies()
    assert (await admit_once_healthy(client)).status_code == 201
    errors_before = metric(
        limiter, "llmquota_store_errors_total", operation="admit", kind="timeout"
    )
    fallbacks_before = metric(
        limiter, "llmquota_fallback_decisions_total", mode="closed", decision="refused"
    )

    paused_at = await db.fetchval("SELECT clock_timestamp()")
    proxy.pause()  # packets dropped: nothing refuses, nothing answers
    started = time.perf_counter()
    responses = await asyncio.gather(
        *(client.post("/v1/admit", json=BODY, headers=ADMIN) for _ in range(10))
    )
    took = time.perf_counter() - started
    assert [r.status_code for r in responses] == [503] * 10
    assert all(r.json()["error"]["type"] == "limiter_unavailable" for r in responses)
    assert all(r.json()["type"] == "error" for r in responses)
    assert took < ANSWER_BOUND_SECONDS, f"10 hung decisions took {took:.3f}s"
    print(f"FIGURE outage closed: 10 concurrent admits on a hung store answered 503 in {took:.3f}s")
    assert (
        metric(limiter, "llmquota_fallback_decisions_total", mode="closed", decision="refused")
        - fallbacks_before
        == 10
    )
    assert (
        metric(limiter, "llmquota_store_errors_total", operation="admit", kind="timeout")
        - errors_before
        == 10
    )
    assert (
        metric(
            limiter,
            "llmquota_policy_denials_total",
            limit="tokens",
            scope="tenant",
            reason="rate_limited",
        )
        == 0
    )

    health = await client.get("/healthz")
    assert health.status_code == 503 and health.json()["error"]["type"] == "limiter_unavailable"

    resumed_at = await db.fetchval("SELECT clock_timestamp()")
    proxy.resume()  # the service recovers by itself: no restart
    back_after = await wait_until_store_answers(client)
    # Once the store answers, the next admit is decided by it: one call, no retry.
    r = await client.post("/v1/admit", json=BODY, headers=ADMIN)
    assert r.status_code == 201, r.text
    assert "llmquota-fallback" not in r.headers
    print(f"FIGURE outage closed: the store answered {back_after:.3f}s after the hang ended")
    # The refused ones left nothing behind.
    assert (
        await count(db, "reservations", "created_at BETWEEN $1 AND $2", paused_at, resumed_at) == 0
    )


async def test_open_mode_admits_during_outage_and_records_exactly_once(
    proxy: PgProxy, database_dsn: str, db: asyncpg.Connection
) -> None:
    limiter = await Limiter.connect(proxy.dsn, fault_settings())
    try:
        await put(
            limiter,
            "tenant",
            "acme",
            tokens_per_minute=1,
            token_burst=1_000_000,
            failure_mode="open",
        )
        await limiter.refresh_policies()
        await proxy.cut()  # connections refused

        held = [
            await limiter.admit(tenant="acme", model="gpt-4o", input_tokens=100, max_tokens=400)
            for _ in range(20)
        ]
        assert all(is_outage_id(r.reservation_id) for r in held)
        assert len(limiter.journal) == 20
        settled = held[:10]
        for i, r in enumerate(settled):
            s = await r.settle(input_tokens=100, output_tokens=i * 10)
            assert (s.charged_tokens, s.refunded_tokens, s.late) == (
                100 + i * 10,
                400 - i * 10,
                False,
            )
            # the same settle again is a replay, not a second charge
            again = await limiter.settle(r.reservation_id, input_tokens=100, output_tokens=i * 10)
            assert again == s
        for r in held[10:13]:
            await r.release()
        assert (
            metric(limiter, "llmquota_fallback_decisions_total", mode="open", decision="admitted")
            == 20
        )

        await proxy.restore()
        await wait_until_recorded(limiter)

        assert await count(db, "reservations", "outage_mode = 'open'") == 20
        assert await count(db, "reservations", "state = 'settled'") == 10
        assert await count(db, "reservations", "state = 'released'") == 3
        assert await count(db, "reservations", "state = 'active'") == 7
        ledger = await db.fetch(
            "SELECT reservation_id, input_tokens, output_tokens FROM usage_ledger"
        )
        assert sorted((row["input_tokens"], row["output_tokens"]) for row in ledger) == [
            (100, i * 10) for i in range(10)
        ]
        # The 7 still active settle through the store like any reservation.
        for r in held[13:]:
            s = await r.settle(input_tokens=100, output_tokens=100)
            assert (s.charged_tokens, s.late) == (200, False)
        assert await count(db, "usage_ledger") == 17

        # A second replay of the same journal (a crash after the commit, or a
        # spool replayed twice) records nothing more.
        duplicate = OutageJournal(max_entries=100)
        for r in held:
            duplicate.add(
                OutageEntry(
                    reservation_id=r.reservation_id,
                    request=AdmitRequest("acme", None, "gpt-4o", 100, 400, False, None, None, None),
                    mode="open",
                    policy_version=1,
                )
            )
        report = await duplicate.flush(limiter.store, batch_size=7, deadline_seconds=5)
        assert report.admissions_recorded == 20  # sent ...
        assert await count(db, "reservations") == 20  # ... and nothing doubled
        assert await count(db, "usage_ledger") == 17
        charged = sum(100 + i * 10 for i in range(10)) + 7 * 200
        row = await layer(db, "acme")
        # Each outage admission debited what it reserved when recorded; the
        # settles refunded the rest: the bucket paid exactly what was used.
        assert 1_000_000 - charged <= row["tokens"] <= 1_000_000 - charged + 1
        assert row["in_flight"] == 0
    finally:
        await limiter.close()


async def test_open_mode_hang_admits_within_deadline(
    app_client: tuple[httpx.AsyncClient, Limiter], proxy: PgProxy, db: asyncpg.Connection
) -> None:
    client, limiter = app_client
    policy = {"tokens_per_minute": 60_000, "failure_mode": "open"}
    assert (await client.put("/v1/tenants/acme/policy", json=policy, headers=ADMIN)).is_success
    await limiter.refresh_policies()
    proxy.pause()
    started = time.perf_counter()
    r = await client.post("/v1/admit", json=BODY, headers=ADMIN)
    took = time.perf_counter() - started
    assert r.status_code == 201, r.text
    assert r.headers["llmquota-fallback"] == "open"
    assert took < ANSWER_BOUND_SECONDS
    print(f"FIGURE outage open: admit on a hung store answered 201 (open) in {took:.3f}s")
    reservation_id = r.json()["reservation_id"]
    settle = await client.post(
        f"/v1/reservations/{reservation_id}/settle",
        json={"input_tokens": 50, "output_tokens": 7},
        headers=ADMIN,
    )
    assert settle.json() == {"charged_tokens": 57, "refunded_tokens": 43, "late": False}
    proxy.resume()
    await wait_until_recorded(limiter)
    row = await db.fetchrow(
        "SELECT state, charged_tokens, outage_mode FROM reservations WHERE reservation_id = $1",
        uuid.UUID(reservation_id),
    )
    assert dict(row) == {"state": "settled", "charged_tokens": 57, "outage_mode": "open"}
    assert await count(db, "usage_ledger", "output_tokens = 7") == 1


async def test_token_headers_and_counts_while_the_store_hangs(
    app_client: tuple[httpx.AsyncClient, Limiter], proxy: PgProxy, db: asyncpg.Connection
) -> None:
    """The store decides: X-TokenLimit-* of the binding layer. It hangs: an open
    admission knows no balance and sends none, and a count of a tenant the policy
    cache holds is still answered (from the cache), one the cache does not is a 503."""
    client, limiter = app_client
    policy = {"tokens_per_minute": 60_000, "token_burst": 10_000, "failure_mode": "open"}
    assert (await client.put("/v1/tenants/acme/policy", json=policy, headers=ADMIN)).is_success
    await limiter.refresh_policies()
    decided = await client.post("/v1/admit", json=BODY, headers=ADMIN)
    assert decided.status_code == 201, decided.text
    assert decided.headers["x-tokenlimit-limit"] == "10000"
    assert decided.headers["x-tokenlimit-remaining"] == "9900"
    released = await client.post(
        f"/v1/reservations/{decided.json()['reservation_id']}/release", headers=ADMIN
    )
    assert released.status_code == 200, released.text

    proxy.pause()
    counted = await client.post("/v1/tokens/count", json=BODY, headers=ADMIN)
    assert counted.status_code == 200, counted.text
    assert counted.json()["reserved_tokens"] == 100
    unknown = await client.post("/v1/tokens/count", json={**BODY, "tenant": "ghost"}, headers=ADMIN)
    assert unknown.status_code == 503, unknown.text
    r = await client.post("/v1/admit", json=BODY, headers=ADMIN)
    assert r.status_code == 201, r.text
    assert r.headers["llmquota-fallback"] == "open"
    assert not {"x-tokenlimit-limit", "x-tokenlimit-remaining", "x-tokenlimit-reset"} & set(
        r.headers
    )
    reservation_id = r.json()["reservation_id"]
    settle = await client.post(
        f"/v1/reservations/{reservation_id}/settle",
        json={"input_tokens": 50, "output_tokens": 7},
        headers=ADMIN,
    )
    assert settle.status_code == 200, settle.text
    proxy.resume()
    await wait_until_recorded(limiter)
    assert await count(db, "usage_ledger", "output_tokens = 7") == 1


async def test_local_mode_admits_a_fraction_of_the_limits(
    proxy: PgProxy, db: asyncpg.Connection
) -> None:
    limiter = await Limiter.connect(proxy.dsn, fault_settings(outage_local_fraction=0.5))
    try:
        # 1,000 tokens of capacity, 10 a second, 6 in flight; locally: 500, 5/s, 3.
        await put(
            limiter,
            "tenant",
            "acme",
            tokens_per_minute=600,
            token_burst=1_000,
            max_in_flight=6,
            failure_mode="local",
        )
        await put(
            limiter,
            "tenant",
            "beta",
            tokens_per_minute=600,
            token_burst=1_000,
            failure_mode="local",
        )
        await limiter.refresh_policies()
        await proxy.cut()

        acme = [
            await limiter.admit(tenant="acme", model="m", input_tokens=0, max_tokens=100)
            for _ in range(3)
        ]
        with pytest.raises(RateLimited) as refused:
            await limiter.admit(tenant="acme", model="m", input_tokens=0, max_tokens=100)
        assert (refused.value.limit, refused.value.scope) == ("concurrency", "tenant")
        await acme[0].release()  # gives its permit and 100 tokens back locally
        acme.append(await limiter.admit(tenant="acme", model="m", input_tokens=0, max_tokens=100))

        beta = [
            await limiter.admit(tenant="beta", model="m", input_tokens=0, max_tokens=100)
            for _ in range(5)
        ]
        with pytest.raises(RateLimited) as refused:
            await limiter.admit(tenant="beta", model="m", input_tokens=0, max_tokens=100)
        assert (refused.value.limit, refused.value.scope) == ("tokens", "tenant")
        # 100 short at 5 tokens/s: about 20 s, never a 503 and never the real limit's 10 s
        assert 19_000 <= refused.value.retry_after_ms <= 20_000
        assert (
            metric(limiter, "llmquota_fallback_decisions_total", mode="local", decision="refused")
            == 2
        )

        await proxy.restore()
        await wait_until_recorded(limiter)
        assert await count(db, "reservations", "outage_mode = 'local'") == 3 + 1 + 5
        assert await count(db, "reservations", "state = 'released'") == 1
        assert (await layer(db, "acme"))["in_flight"] == 3
        assert (await layer(db, "beta"))["in_flight"] == 5
        for r in acme[1:] + beta:
            await r.settle(input_tokens=0, output_tokens=10)
        assert await count(db, "usage_ledger") == 8
    finally:
        await limiter.close()


async def test_a_local_decision_reserves_max_tokens_of_the_model_it_admits(
    proxy: PgProxy, db: asyncpg.Connection
) -> None:
    """The outage sibling of a degraded admission's reserve (issue 23): a failure
    mode decides the requested model only (it never degrades) and reserves its
    max_tokens, whatever the learned estimates of it or its fallbacks say; the
    answer says so, and the replay records exactly that."""
    limiter = await Limiter.connect(proxy.dsn, fault_settings())
    try:
        learned = LearnedEstimate(strategy="learned", quantile=0.95, min_samples=10)
        await put(
            limiter,
            "tenant",
            "acme",
            tokens_per_minute=600_000,
            token_burst=100_000,
            failure_mode="local",
            output_estimate=learned,
        )
        rows = [("gpt-4o", 1000)] * 10 + [("gpt-4o-mini", 100)] * 10
        await db.execute(
            "SELECT lq_record_output_samples($1::text[], $2::text[], $3::text[], $4::bigint[])",
            ["acme"] * len(rows),
            [None] * len(rows),
            [model for model, _ in rows],
            [output for _, output in rows],
        )
        await limiter.refresh_policies()
        await limiter.estimates.refresh()
        await proxy.cut()
        held = await limiter.admit(
            tenant="acme",
            model="gpt-4o",
            input_tokens=10,
            max_tokens=4000,
            fallback_models=["gpt-4o-mini"],
        )
        assert held.fallback == "local"
        assert not held.degraded
        assert held.output_estimate == {"strategy": "max_tokens", "tokens": 4000}
        assert held.reserved_tokens == 4010
        await proxy.restore()
        await wait_until_recorded(limiter)
        row = await db.fetchrow("SELECT model, reserved_tokens FROM reservations")
        assert row is not None
        assert tuple(row) == ("gpt-4o", 4010)
        assert (await layer(db, "acme"))["tokens"] == pytest.approx(100_000 - 4010, abs=1)
        await held.release()
    finally:
        await limiter.close()


async def test_cached_policies_rule_during_outage_and_refresh_after(
    proxy: PgProxy, database_dsn: str
) -> None:
    admin = await Limiter.connect(database_dsn, fault_settings())
    limiter = await Limiter.connect(proxy.dsn, fault_settings(policy_cache_refresh_seconds=0.2))
    try:
        await put(admin, "tenant", "acme", tokens_per_minute=60_000, failure_mode="open")
        await limiter.refresh_policies()
        version = limiter.policies.version
        await proxy.cut()
        r = await limiter.admit(tenant="acme", model="m", input_tokens=1, max_tokens=1)
        assert is_outage_id(r.reservation_id)  # the last valid rules: open
        # The rules change while this worker cannot see the store.
        await put(admin, "tenant", "acme", tokens_per_minute=60_000, failure_mode="closed")
        await proxy.restore()
        await wait_until_recorded(limiter)
        await asyncio.sleep(0.25)
        await limiter.admit(tenant="acme", model="m", input_tokens=1, max_tokens=1)
        deadline = time.monotonic() + 5
        while limiter.policies.version == version:
            assert time.monotonic() < deadline, "policies were not refreshed"
            await asyncio.sleep(0.05)
        await proxy.cut()
        with pytest.raises(StoreUnavailable, match="closed"):
            await limiter.admit(tenant="acme", model="m", input_tokens=1, max_tokens=1)
        await proxy.restore()
    finally:
        await limiter.close()
        await admin.close()


async def test_expired_policy_cache_counts_as_closed(proxy: PgProxy) -> None:
    limiter = await Limiter.connect(proxy.dsn, fault_settings(policy_cache_max_stale_seconds=0.3))
    try:
        await put(limiter, "tenant", "acme", tokens_per_minute=60_000, failure_mode="open")
        await limiter.refresh_policies()
        await proxy.cut()
        await limiter.admit(tenant="acme", model="m", input_tokens=1, max_tokens=1)
        await asyncio.sleep(0.4)
        with pytest.raises(StoreUnavailable, match="no current cached policy"):
            await limiter.admit(tenant="acme", model="m", input_tokens=1, max_tokens=1)
        await proxy.restore()
        await wait_until_recorded(limiter)
    finally:
        await limiter.close()


async def test_spooled_outage_admissions_survive_a_killed_worker(
    proxy: PgProxy, database_dsn: str, db: asyncpg.Connection, tmp_path: Path
) -> None:
    spool = tmp_path / "spool"
    admin = await Limiter.connect(database_dsn, fault_settings())
    await put(admin, "tenant", "acme", tokens_per_minute=60_000, failure_mode="open")
    await admin.close()
    worker = await Worker.start(
        proxy.dsn, LLMQUOTA_OUTAGE_SPOOL_DIR=str(spool), LLMQUOTA_DECISION_DEADLINE_MS="1000"
    )
    try:
        await proxy.cut()
        result = await worker.call(
            op="admit", tenant="acme", model="m", input_tokens=10, max_tokens=90, count=12
        )
        ids = [a["reservation_id"] for a in result["admitted"]]
        assert len(ids) == 12
        for i, reservation_id in enumerate(ids[:5]):
            answer = await worker.call(
                op="settle", reservation_id=reservation_id, input_tokens=10, output_tokens=i
            )
            assert answer == {"charged_tokens": 10 + i, "late": False}
        worker.process.kill()  # -9: the worker's memory is gone, its spool file is not
        await worker.process.wait()
    finally:
        await worker.stop()
    await proxy.restore()

    survivor = await Limiter.connect(proxy.dsn, fault_settings(outage_spool_dir=str(spool)))
    try:
        await wait_until_recorded(survivor)
        assert await count(db, "reservations", "outage_mode = 'open'") == 12
        rows = await db.fetch("SELECT output_tokens FROM usage_ledger ORDER BY output_tokens")
        assert [row["output_tokens"] for row in rows] == [0, 1, 2, 3, 4]
        assert await count(db, "reservations", "state = 'active'") == 7
        for reservation_id in ids[5:]:
            await survivor.release(uuid.UUID(reservation_id))
    finally:
        await survivor.close()
    assert list(spool.glob("spool-*.jsonl")) == []  # nothing left to replay


async def test_a_made_up_outage_id_is_404_and_an_unrecorded_real_one_503(
    database_dsn: str,
) -> None:
    """An id of the outage form that no worker signed is not found once the
    store answers; one that a worker did sign (another worker's, not recorded
    yet) is a retryable 503."""
    limiter = await Limiter.connect(database_dsn, fault_settings())
    other = await Limiter.connect(database_dsn, fault_settings())
    try:
        await put(limiter, "tenant", "acme", max_in_flight=10)
        made_up = uuid.UUID(bytes=bytes([*uuid.uuid4().bytes[:6], 0x80, *uuid.uuid4().bytes[7:]]))
        assert is_outage_id(made_up)
        with pytest.raises(ReservationNotFound):
            await limiter.settle(made_up, input_tokens=1, output_tokens=1)
        with pytest.raises(ReservationNotFound):
            await limiter.release(made_up)
        # Signed by a worker of the same database, journaled there, not recorded yet.
        assert other.fallback.id_key is not None
        theirs = new_outage_id(other.fallback.id_key)
        with pytest.raises(StoreUnavailable, match="not recorded yet"):
            await limiter.settle(theirs, input_tokens=1, output_tokens=1)
    finally:
        await other.close()
        await limiter.close()
