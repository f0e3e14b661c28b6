"""Authentication keeps the outage promises: a real uvicorn server, real sockets, a real hang.

The database is reached through a proxy the test controls (`pause()` drops
packets: nothing refuses, nothing answers). Known keys keep working through
the outage, so `open` and `local` keep admitting; a key the worker has never
seen gets a quick 503; every endpoint that needs the database answers 503
within its deadline instead of hanging. With the store up, an unknown key
gets 401 and its repeat costs no lookup, and a client that keeps failing is
refused with 429 before any lookup. The lookups are counted by the server's
own metrics (GET /metrics).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import asyncpg
import httpx
import pytest
from fastapi import FastAPI

from llmquota.api.fairness import MAX_HOLD_SECONDS
from llmquota.config import Settings
from tests.faults.conftest import (
    PYTHON,
    fault_settings,
    metric_value,
    serving,
    serving_process,
    timed,
    wait_for,
    worker_env,
)
from tests.faults.proxy import PgProxy
from tests.support import announcements_applied

ADMIN_KEY = "lq_auth_admin_key_0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
DEADLINE_MS = 250
# A hung lookup or decision answers within its deadline plus this slack: the
# loop's scheduling on a shared 2-core machine (a timer fires 10-40 ms late,
# a request takes a few loop turns each way) and at most a credited stall
# (store/deadline.py). Profiled with three CPU hogs beside the test: the
# slowest of 28 answers 0.432 s. (The old tail, up to 1.14 s, was the
# deadline crediting that scheduling jitter as a stall, again and again:
# each credit re-armed a timer as late as the last.)
ANSWER_SLACK_SECONDS = 0.3
ANSWER_BOUND_SECONDS = DEADLINE_MS / 1000 + ANSWER_SLACK_SECONDS
# Through a whole minute of hung store the open/local answers are bounded
# apart: the full suite's CI run measured a slowest of 1.109 s among 156
# (a run alone: 0.43 s). What makes that tail is not found yet (the credited
# scheduling jitter above was one cause, and is gone); what this proves is
# that no answer waits for the store, which would be the whole 60 s.
OUTAGE_ANSWER_BOUND_SECONDS = 1.5
LOOKUPS = "llmquota_key_lookups_total"
FLOODER = str(Path(__file__).with_name("flooder.py"))
FLOODERS = 4
FLOOD_SECONDS = 4.0
THROTTLED = 5


def body(tenant: str) -> dict[str, object]:
    return {"tenant": tenant, "model": "gpt-4o", "input_tokens": 10, "max_tokens": 10}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def random_key() -> dict[str, str]:
    """The headers of a key nobody issued."""
    return bearer("lq_" + secrets.token_urlsafe(32))


async def admit(
    client: httpx.AsyncClient, headers: dict[str, str], tenant: str = "acme"
) -> httpx.Response:
    return await client.post("/v1/admit", json=body(tenant), headers=headers)


def outage_settings(**overrides: object) -> Settings:
    values: dict[str, object] = {"admin_key": ADMIN_KEY, "decision_deadline_ms": DEADLINE_MS}
    values.update(overrides)
    return fault_settings(**values)


async def new_tenant(client: httpx.AsyncClient, tenant: str, **policy: object) -> str:
    """Give a tenant a policy and a key (which the worker has not seen yet)."""
    r = await client.put(f"/v1/tenants/{tenant}/policy", json=policy, headers=ADMIN)
    assert r.status_code == 200, r.text
    r = await client.post(f"/v1/tenants/{tenant}/keys", headers=ADMIN)
    assert r.status_code == 201, r.text
    return str(r.json()["key"])


async def known_to_the_worker(
    app: FastAPI, client: httpx.AsyncClient, dsn: str, tenant: str, **policy: object
) -> dict[str, str]:
    """A new tenant's key that the worker knows without a lookup, and that no
    announcement still on its way will make it forget (its next use would be
    looked up again, which a client out of its failure budget is not allowed;
    CI's Python 3.13 leg, run side by side with two others, met it)."""
    key = bearer(await new_tenant(client, tenant, **policy))
    await announcements_applied(app, dsn)
    assert (await admit(client, key)).status_code == 201
    assert app.state.authenticator.triage(key["Authorization"], "127.0.0.1").lane == tenant
    return key


async def decided_by_store(client: httpx.AsyncClient, tenant: str, key: str) -> httpx.Response:
    """POST /v1/admit until the store decides it (a busy machine may time one out); 10 s."""
    deadline = time.monotonic() + 10
    while True:
        r = await admit(client, bearer(key), tenant)
        decided = r.status_code == 201 and "llmquota-fallback" not in r.headers
        if decided or time.monotonic() > deadline:
            return r
        await asyncio.sleep(0.1)


async def listening(dsn: str) -> None:
    """Wait (10 s at most) until the server's change listener has started
    listening: its first LISTEN resynchronises the key cache (any lookup in
    flight then is not remembered), which a count of lookups must not meet."""
    connection = await asyncpg.connect(dsn)
    try:
        deadline = time.monotonic() + 10
        while not await connection.fetchval(
            """SELECT count(*) FROM pg_stat_activity
                WHERE application_name = 'llmquota-listener' AND datname = current_database()
                  AND (query LIKE 'LISTEN%' OR query = 'SELECT 1')"""
        ):
            assert time.monotonic() < deadline, "the change listener never listened"
            await asyncio.sleep(0.02)
    finally:
        await connection.close()
    await asyncio.sleep(0.05)  # the resync runs right after LISTEN returns


async def lookups(client: httpx.AsyncClient, purpose: str, result: str) -> float:
    text = (await client.get("/metrics")).text
    return metric_value(text, LOOKUPS, purpose=purpose, result=result)


@pytest.mark.slow
async def test_open_and_local_keep_admitting_through_a_60s_outage(
    proxy: PgProxy, db: asyncpg.Connection
) -> None:
    """The outage outlasts the old hard-coded 30 s key cache, at the default settings."""
    settings = outage_settings()
    assert settings.key_cache_refresh_seconds == 30.0
    async with (
        serving(settings, proxy.dsn) as (base, app),
        httpx.AsyncClient(base_url=base, timeout=10) as client,
    ):
        policy = {"tokens_per_minute": 6_000_000, "requests_per_minute": 60_000}
        keys = {
            "opentenant": await new_tenant(client, "opentenant", **policy, failure_mode="open"),
            "localtenant": await new_tenant(client, "localtenant", **policy, failure_mode="local"),
        }
        for tenant, key in keys.items():  # the worker learns the keys
            assert (await decided_by_store(client, tenant, key)).status_code == 201
        await app.state.limiter.refresh_policies()

        proxy.pause()
        started = time.monotonic()
        answers: list[tuple[int, str | None, float]] = []
        while time.monotonic() - started < 60:
            rounds = await asyncio.gather(
                *(timed(admit(client, bearer(key), tenant)) for tenant, key in keys.items())
            )
            answers += [(r.status_code, r.headers.get("llmquota-fallback"), t) for r, t in rounds]
            await asyncio.sleep(0.5)
        outage_seconds = time.monotonic() - started
        failed_refreshes = await lookups(client, "refresh", "unavailable")
        proxy.resume()

        statuses = {(status, mode) for status, mode, _ in answers}
        slowest = max(took for _, _, took in answers)
        print(
            f"FIGURE auth 60s outage: {len(answers)} admits over {outage_seconds:.1f} s of "
            f"hung store, all {statuses}; slowest {slowest:.3f}s; "
            f"{failed_refreshes:.0f} background key refreshes failed meanwhile"
        )
        assert outage_seconds >= 60
        assert statuses == {(201, "open"), (201, "local")}
        assert len(answers) >= 100
        assert slowest < OUTAGE_ANSWER_BOUND_SECONDS
        # Each key was due for a refresh (30 s) during the outage; the refresh
        # failed and the key kept working.
        assert failed_refreshes >= 2
        for tenant, key in keys.items():
            r = await decided_by_store(client, tenant, key)
            assert r.status_code == 201 and "llmquota-fallback" not in r.headers
        deadline = time.monotonic() + 10
        while len(app.state.limiter.journal):
            assert time.monotonic() < deadline, "the outage journal was not recorded"
            await asyncio.sleep(0.05)
    recorded = await db.fetchval("SELECT count(*) FROM reservations WHERE outage_mode IS NOT NULL")
    assert recorded == len(answers)


@pytest.mark.slow
async def test_a_key_outlives_its_refresh_age_during_a_hang_and_goes_once_deleted(
    proxy: PgProxy, db: asyncpg.Connection
) -> None:
    refresh_seconds = 0.5
    hang_seconds = 8.0
    # The refresh is the safety net under announced changes: this proves it
    # alone (test_freshness.py proves the announcement of a deleted key).
    settings = outage_settings(
        key_cache_refresh_seconds=refresh_seconds,
        key_negative_cache_seconds=5.0,
        change_notifications=False,
    )
    async with (
        serving(settings, proxy.dsn) as (base, app),
        httpx.AsyncClient(base_url=base, timeout=10) as client,
    ):
        key = await new_tenant(client, "acme", tokens_per_minute=6_000_000, failure_mode="open")
        assert (await decided_by_store(client, "acme", key)).status_code == 201
        await app.state.limiter.refresh_policies()

        proxy.pause()
        started = time.monotonic()
        answers = []
        while time.monotonic() - started < hang_seconds:
            used_at = time.monotonic()
            r = await admit(client, bearer(key), "acme")
            answers.append((r.status_code, r.headers.get("llmquota-fallback")))
            # The next use past the refresh age: each one claims a refresh.
            await asyncio.sleep(max(0.0, used_at + refresh_seconds + 0.1 - time.monotonic()))
        # The last refresh fails within its deadline too.
        await asyncio.sleep(ANSWER_BOUND_SECONDS)
        failed_refreshes = await lookups(client, "refresh", "unavailable")
        proxy.resume()
        print(
            f"FIGURE auth key past refresh age: {len(answers)} admits over {hang_seconds} s "
            f"({hang_seconds / refresh_seconds:.0f}x the {refresh_seconds} s refresh age) "
            f"on a hung store, all {set(answers)}; {failed_refreshes:.0f} refreshes failed"
        )
        assert set(answers) == {(201, "open")} and len(answers) >= 12
        # Every use past the refresh age tried a refresh, and each failed (the
        # first use may come before the age: the key was confirmed just before).
        assert len(answers) - 1 <= failed_refreshes <= len(answers), (answers, failed_refreshes)

        # Back: the next use past the refresh age confirms the key in the background.
        assert (await decided_by_store(client, "acme", key)).status_code == 201
        found_before = await lookups(client, "refresh", "found")
        await asyncio.sleep(refresh_seconds + 0.1)
        assert (await client.get("/v1/tenants/acme/status", headers=bearer(key))).is_success

        async def refreshed() -> bool:
            return await lookups(client, "refresh", "found") > found_before

        await wait_for(refreshed, 5)

        # Deleted from the database: the next use past the refresh age is still
        # served from memory, its refresh finds the key gone, and then it is refused.
        await db.execute("DELETE FROM api_keys WHERE tenant = 'acme'")
        await asyncio.sleep(refresh_seconds + 0.1)
        assert (await client.get("/v1/tenants/acme/status", headers=bearer(key))).is_success

        async def dropped() -> bool:
            return await lookups(client, "refresh", "absent") == 1

        await wait_for(dropped, 5)
        first_lookups = await lookups(client, "first", "absent")
        r = await client.get("/v1/tenants/acme/status", headers=bearer(key))
        assert r.status_code == 401
        # Refused from memory: the refresh that found it gone remembered that.
        assert await lookups(client, "first", "absent") == first_lookups


async def test_frozen_database_answers_every_endpoint_within_its_deadline(
    proxy: PgProxy,
) -> None:
    statement_timeout_ms = 1_500
    settings = outage_settings(statement_timeout_ms=statement_timeout_ms)
    async with (
        serving(settings, proxy.dsn) as (base, _app),
        httpx.AsyncClient(base_url=base, timeout=10) as client,
    ):
        known = await new_tenant(client, "acme", tokens_per_minute=60_000)
        unseen = await new_tenant(client, "newco", tokens_per_minute=60_000)
        assert (await decided_by_store(client, "acme", known)).status_code == 201

        proxy.pause()
        calls: dict[str, Callable[[], Awaitable[httpx.Response]]] = {
            "admit, never-seen key": lambda: client.post(
                "/v1/admit", json=body("newco"), headers=bearer(unseen)
            ),
            "status, never-seen key": lambda: client.get(
                "/v1/tenants/newco/status", headers=bearer(unseen)
            ),
            "status, known key": lambda: client.get(
                "/v1/tenants/acme/status", headers=bearer(known)
            ),
            "status, admin": lambda: client.get("/v1/tenants/acme/status", headers=ADMIN),
            "get global policy": lambda: client.get("/v1/policies/global", headers=ADMIN),
            "put global policy": lambda: client.put(
                "/v1/policies/global", json={"max_in_flight": 100}, headers=ADMIN
            ),
            "get tenant policy": lambda: client.get("/v1/tenants/acme/policy", headers=ADMIN),
            "put route policy": lambda: client.put(
                "/v1/tenants/acme/routes/chat/policy", json={"max_in_flight": 1}, headers=ADMIN
            ),
            "create key": lambda: client.post("/v1/tenants/acme/keys", headers=ADMIN),
            "usage, known key": lambda: client.get("/v1/tenants/acme/usage", headers=bearer(known)),
        }
        took: dict[str, float] = {}
        for name, call in calls.items():
            r, took[name] = await timed(call())
            assert r.status_code == 503, (name, r.status_code, r.text)
            assert r.json()["error"]["type"] == "limiter_unavailable", name
        proxy.resume()
        print(
            "FIGURE auth frozen database, seconds to 503: "
            + ", ".join(f"{name} {seconds:.3f}" for name, seconds in took.items())
        )
        usage = took.pop("usage, known key")
        # The promise for a never-seen key is an answer within 1 s.
        assert took["admit, never-seen key"] < 1.0
        assert max(took.values()) < ANSWER_BOUND_SECONDS, took
        # Usage sums ledger rows: its deadline is the statement timeout.
        assert usage < statement_timeout_ms / 1000 + 0.5
        # A 503 is not remembered as "no such key": the key works once the store is back.
        r = await decided_by_store(client, "newco", unseen)
        assert r.status_code == 201


async def test_an_unknown_key_gets_401_and_repeating_it_costs_no_lookup(
    database_dsn: str,
) -> None:
    negative_seconds = 1.0
    settings = outage_settings(
        decision_deadline_ms=5_000, key_negative_cache_seconds=negative_seconds
    )
    async with (
        serving(settings, database_dsn) as (base, _app),
        httpx.AsyncClient(base_url=base, timeout=10) as client,
    ):
        await listening(database_dsn)
        wrong = bearer("lq_" + secrets.token_urlsafe(32))
        r = await admit(client, wrong)
        assert r.status_code == 401
        assert (r.json()["type"], r.json()["error"]["type"]) == ("error", "authentication_error")
        assert r.json()["error"]["message"] == "missing or invalid API key"
        assert await lookups(client, "first", "absent") == 1
        started = time.monotonic()
        for _ in range(5):
            r, took = await timed(admit(client, wrong))
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert time.monotonic() - started < negative_seconds
        assert await lookups(client, "first", "absent") == 1  # no lookup for the repeats
        # Endpoints that take no API key answer whatever header comes with them.
        assert (await client.get("/healthz", headers=wrong)).status_code == 200
        assert (await client.get("/metrics", headers=wrong)).status_code == 200
        # No key at all is refused before any lookup too.
        r = await client.post("/v1/admit", json=body("acme"))
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"

        # Ten requests at once with another new key: one lookup between them.
        other = bearer("lq_" + secrets.token_urlsafe(32))
        answers = await asyncio.gather(
            *(client.get("/v1/tenants/acme/status", headers=other) for _ in range(10))
        )
        assert [a.status_code for a in answers] == [401] * 10
        # One shared lookup; a second only when the key cache was resynchronised
        # while the first was in flight (its answer is then not remembered, so
        # that a key revoked meanwhile cannot come back), as the full suite
        # on CI's machine met twice. Never one per request.
        shared = await lookups(client, "first", "absent") - 1
        assert 1 <= shared <= 2, shared

        # Past the negative window the key is looked up again.
        await asyncio.sleep(negative_seconds + 0.1)
        assert (await admit(client, wrong)).status_code == 401
        assert await lookups(client, "first", "absent") == 2 + shared
        print(
            "FIGURE auth negative cache: 1 lookup for an unknown key and its 5 repeats, "
            f"{shared:.0f} for 10 concurrent requests with another; the repeat {took * 1000:.1f} ms"
        )


async def test_a_client_out_of_its_failure_budget_gets_429_before_any_lookup(
    database_dsn: str,
) -> None:
    # One failure back every 5 s: the burst's ten lookups may take seconds on a
    # busy machine (CI's legs run side by side), and none may come back meanwhile.
    burst, per_second = 10, 0.2
    settings = outage_settings(
        decision_deadline_ms=5_000, auth_failure_burst=burst, auth_failures_per_second=per_second
    )
    async with (
        serving(settings, database_dsn) as (base, app),
        httpx.AsyncClient(base_url=base, timeout=10) as client,
    ):
        key = await known_to_the_worker(
            app, client, database_dsn, "acme", tokens_per_minute=6_000_000
        )
        assert [(await admit(client, random_key())).status_code for _ in range(burst)] == [
            401
        ] * burst
        assert await lookups(client, "first", "absent") == burst
        # At once: each of these 429s is held for its retry hint before it is sent.
        started = time.perf_counter()
        refused = await asyncio.gather(*(admit(client, random_key()) for _ in range(THROTTLED)))
        held = time.perf_counter() - started
        assert {r.status_code for r in refused} == {429}
        error = refused[-1].json()["error"]
        assert (refused[-1].json()["type"], error["type"], error["limit"], error["scope"]) == (
            "error",
            "rate_limit_error",
            "authentication_failures",
            "client",
        )
        assert 0 < error["retry_after_ms"] <= 1_000 / per_second
        assert refused[-1].headers["retry-after-ms"] == str(error["retry_after_ms"])
        assert held >= 0.9 * min(error["retry_after_ms"] / 1000, MAX_HOLD_SECONDS)
        # Refused before any database work.
        assert await lookups(client, "first", "absent") == burst
        # A known key from the same address is not affected, nor is another address.
        known = await admit(client, key)
        assert known.status_code == 201, known.text
        other_address = httpx.AsyncHTTPTransport(local_address="127.0.0.2")
        async with httpx.AsyncClient(base_url=base, transport=other_address) as elsewhere:
            assert (await admit(elsewhere, random_key())).status_code == 401
        # Once the bucket refills, this address may fail (and be looked up) again.
        await asyncio.sleep(error["retry_after_ms"] / 1000 + 0.05)
        assert (await admit(client, random_key())).status_code == 401
        assert await lookups(client, "first", "absent") == burst + 2
        exposition = (await client.get("/metrics")).text
    throttled = metric_value(exposition, "llmquota_auth_refusals_total", reason="throttled")
    assert throttled == THROTTLED
    print(
        f"FIGURE auth failure budget: {burst} failures looked up, then {THROTTLED} "
        f"concurrent requests refused 429 with no lookup, answered after {held:.3f}s "
        f"(retry hint {error['retry_after_ms']} ms, held at most {MAX_HOLD_SECONDS} s)"
    )


async def quiet_admits(client: httpx.AsyncClient, key: str, seconds: float) -> list[float]:
    """Admit after admit, 20 ms apart, for `seconds`; their latencies in milliseconds."""
    latencies: list[float] = []
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        started = time.perf_counter()
        r = await admit(client, bearer(key), "quiet")
        latencies.append((time.perf_counter() - started) * 1000)
        assert r.status_code == 201, r.text
        await asyncio.sleep(0.02)
    return latencies


@pytest.mark.slow
async def test_an_invalid_key_flood_does_not_slow_a_quiet_tenant(
    database_dsn: str, tmp_path: Path
) -> None:
    async with (
        serving_process(database_dsn, ADMIN_KEY, tmp_path / "server.log") as base,
        httpx.AsyncClient(base_url=base, timeout=30) as client,
    ):
        key = await new_tenant(
            client, "quiet", tokens_per_minute=100_000_000, requests_per_minute=1_000_000
        )
        await quiet_admits(client, key, 1.0)  # warm: the key is known, the pool open
        alone = await quiet_admits(client, key, FLOOD_SECONDS)
        lookups_before = await lookups(client, "first", "absent")

        flood = await asyncio.create_subprocess_exec(
            *(PYTHON, FLOODER, base.rsplit(":", 1)[1], str(FLOODERS), str(FLOOD_SECONDS + 1)),
            stdout=asyncio.subprocess.PIPE,
            env=worker_env(),
        )
        assert flood.stdout is not None
        assert json.loads(await flood.stdout.readline()) == {"ready": True}
        await asyncio.sleep(0.5)  # the flood is on: past its burst, into the throttle
        flooded = await quiet_admits(client, key, FLOOD_SECONDS)
        statuses = json.loads(await flood.stdout.readline())
        await flood.wait()
        flood_lookups = await lookups(client, "first", "absent") - lookups_before
        again = await quiet_admits(client, key, FLOOD_SECONDS)

    p50_alone = statistics.median(alone + again)
    p50_flooded = statistics.median(flooded)
    ratio = p50_flooded / p50_alone
    flood_requests = sum(statuses.values())
    print(
        f"FIGURE auth flood: quiet p50 alone {p50_alone:.2f} ms ({len(alone) + len(again)} "
        f"admits), under a flood of {FLOODERS} random-key clients {p50_flooded:.2f} ms "
        f"({len(flooded)} admits), ratio {ratio:.2f}; the flood sent {flood_requests} "
        f"requests ({flood_requests / (FLOOD_SECONDS + 1):.0f}/s), answers {statuses}, "
        f"{flood_lookups:.0f} of them looked up"
    )
    assert ratio <= 2.0
    assert flood_requests >= 500
    # Past the burst (40) the address may fail 20 times a second: the rest never
    # reached the database.
    assert flood_lookups <= 40 + 20 * (FLOOD_SECONDS + 2)
    assert statuses.get("429", 0) > flood_requests / 2
