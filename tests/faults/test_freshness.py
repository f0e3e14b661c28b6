"""Every admission sees the policy committed before it: on the worker that wrote it
at once, on every other within a second (NOTIFY), also through an outage.

Two real server processes (two workers, each its own policy cache) reach the
database through a proxy the test controls. Their periodic policy refresh is
set to an hour, so whatever reaches the other worker in time came by the
announcement (store/listener.py), not by the safety net.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import httpx

from llmquota.domain.keys import key_digest
from tests.faults.conftest import serving_process
from tests.faults.proxy import PgProxy

ADMIN_KEY = "lq_freshness_admin_key_012345"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
INPUT_TOKENS = 10
MAX_TOKENS = 1_000
# What the other worker is given to apply an announced change.
OTHER_WORKER_SECONDS = 1.0
# The brief's promise: a policy committed this long before an outage rules it.
BEFORE_OUTAGE_SECONDS = 1.5
LISTENER = "llmquota-listener"


@contextlib.asynccontextmanager
async def two_workers(
    dsn: str, tmp_path: Path
) -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient]]:
    settings = {
        "policy_cache_refresh_seconds": "3600",
        "decision_deadline_ms": "500",
        "outage_probe_seconds": "0.1",
    }
    async with (
        serving_process(dsn, ADMIN_KEY, tmp_path / "a.log", **settings) as base_a,
        serving_process(dsn, ADMIN_KEY, tmp_path / "b.log", **settings) as base_b,
        httpx.AsyncClient(base_url=base_a, timeout=30, headers=ADMIN) as a,
        httpx.AsyncClient(base_url=base_b, timeout=30, headers=ADMIN) as b,
    ):
        yield a, b


async def admit(client: httpx.AsyncClient, tenant: str) -> httpx.Response:
    return await client.post(
        "/v1/admit",
        json={
            "tenant": tenant,
            "model": "gpt-4o",
            "input_tokens": INPUT_TOKENS,
            "max_tokens": MAX_TOKENS,
        },
    )


async def reserved_output(client: httpx.AsyncClient, tenant: str) -> int:
    r = await admit(client, tenant)
    assert r.status_code == 201, r.text
    assert "llmquota-fallback" not in r.headers, r.headers
    body = r.json()
    assert body["reserved_tokens"] == INPUT_TOKENS + body["output_estimate"]["tokens"], body
    return int(body["output_estimate"]["tokens"])


async def seconds_until_reserved(client: httpx.AsyncClient, tenant: str, output: int) -> float:
    """Admit on `client` until it reserves `output` for output; how long that took."""
    started = time.monotonic()
    while await reserved_output(client, tenant) != output:
        assert time.monotonic() - started < 10, f"never reserved {output}"
        await asyncio.sleep(0.02)
    return time.monotonic() - started


async def put(client: httpx.AsyncClient, path: str, body: dict[str, object]) -> None:
    r = await client.put(path, json=body)
    assert r.status_code in (200, 201), r.text


async def listener_pids(db: asyncpg.Connection) -> set[int]:
    rows = await db.fetch(
        """SELECT pid FROM pg_stat_activity
            WHERE application_name = $1 AND datname = current_database()""",
        LISTENER,
    )
    return {int(row["pid"]) for row in rows}


async def wait_for_listeners(db: asyncpg.Connection, not_in: set[int]) -> set[int]:
    """Both workers listening, on sessions other than `not_in`."""
    started = time.monotonic()
    while True:
        pids = await listener_pids(db)
        if len(pids) == 2 and not pids & not_in:
            return pids
        assert time.monotonic() - started < 15, f"listeners {pids}, old {not_in}"
        await asyncio.sleep(0.05)


def fixed(tokens: int) -> dict[str, object]:
    return {"strategy": "fixed", "tokens": tokens}


async def key_deletion_seconds(
    a: httpx.AsyncClient, b: httpx.AsyncClient, db: asyncpg.Connection
) -> float:
    """A key deleted: how long until the other worker, which knew it, refuses it."""
    r = await a.post("/v1/tenants/fresh/keys")
    assert r.status_code == 201, r.text
    tenant_key = {"Authorization": f"Bearer {r.json()['key']}"}
    assert (await b.get("/v1/tenants/fresh/status", headers=tenant_key)).status_code == 200
    await db.execute("DELETE FROM api_keys WHERE key_hash = $1", key_digest(r.json()["key"]))
    deleted = time.monotonic()
    while (await b.get("/v1/tenants/fresh/status", headers=tenant_key)).status_code != 401:
        assert time.monotonic() - deleted < 10, "the deleted key kept working"
        await asyncio.sleep(0.02)
    seconds = time.monotonic() - deleted
    assert seconds < OTHER_WORKER_SECONDS
    return seconds


async def listener_killed(
    a: httpx.AsyncClient, b: httpx.AsyncClient, db: asyncpg.Connection, limits: dict[str, int]
) -> tuple[float, float]:
    """Both listeners' sessions killed: (seconds until both listen again,
    seconds until the other worker applies the next change)."""
    old = await listener_pids(db)
    await db.fetch("SELECT pg_terminate_backend(pid) FROM unnest($1::int[]) AS pid", list(old))
    started = time.monotonic()
    await wait_for_listeners(db, old)
    reconnect_seconds = time.monotonic() - started
    await put(a, "/v1/tenants/fresh/policy", {**limits, "output_estimate": fixed(150)})
    assert await reserved_output(a, "fresh") == 150
    after_kill_seconds = await seconds_until_reserved(b, "fresh", 150)
    assert after_kill_seconds < OTHER_WORKER_SECONDS
    return reconnect_seconds, after_kill_seconds


async def test_policy_plan_and_ceiling_changes_apply_at_once_and_through_an_outage(
    proxy: PgProxy, db: asyncpg.Connection, tmp_path: Path
) -> None:
    async with two_workers(proxy.dsn, tmp_path) as (a, b):
        await wait_for_listeners(db, set())
        limits = {"tokens_per_minute": 10_000_000, "max_in_flight": 100_000}
        await put(a, "/v1/tenants/fresh/policy", limits)
        assert await reserved_output(a, "fresh") == MAX_TOKENS
        assert await reserved_output(b, "fresh") == MAX_TOKENS

        # A tenant policy: the writer's next admit, the other worker within a second.
        await put(a, "/v1/tenants/fresh/policy", {**limits, "output_estimate": fixed(300)})
        assert await reserved_output(a, "fresh") == 300
        policy_seconds = await seconds_until_reserved(b, "fresh", 300)
        assert policy_seconds < OTHER_WORKER_SECONDS

        # A plan: every tenant on it, the same way.
        await put(a, "/v1/plans/fresh-plan", {"priority": "normal", **limits})
        await put(a, "/v1/tenants/planned/policy", {"plan": "fresh-plan"})
        assert await reserved_output(a, "planned") == MAX_TOKENS
        assert await reserved_output(b, "planned") == MAX_TOKENS
        await put(
            a,
            "/v1/plans/fresh-plan",
            {"priority": "normal", **limits, "output_estimate": fixed(200)},
        )
        assert await reserved_output(a, "planned") == 200
        plan_seconds = await seconds_until_reserved(b, "planned", 200)
        assert plan_seconds < OTHER_WORKER_SECONDS

        # A provider ceiling: one permit while the test holds more than one.
        await put(a, "/v1/ceilings/fresh-ceiling", {"models": ["gpt-4o"], "max_in_flight": 100_000})
        assert await reserved_output(a, "fresh") == 300
        assert await reserved_output(b, "fresh") == 300
        await put(a, "/v1/ceilings/fresh-ceiling", {"models": ["gpt-4o"], "max_in_flight": 1})
        for worker in (a, b):
            refused = await admit(worker, "fresh")
            assert refused.status_code == 429, refused.text
            error = refused.json()["error"]
            assert (error["limit"], error["scope"]) == ("concurrency", "ceiling"), error
        assert (await a.delete("/v1/ceilings/fresh-ceiling")).status_code in (200, 204)

        key_seconds = await key_deletion_seconds(a, b, db)
        reconnect_seconds, after_kill_seconds = await listener_killed(a, b, db, limits)

        # A tenant created 1.5 s before an outage is decided by its own failure
        # mode on the other worker, not as `closed` for want of a cached policy.
        await put(a, "/v1/tenants/newcomer/policy", {**limits, "failure_mode": "local"})
        await asyncio.sleep(BEFORE_OUTAGE_SECONDS)
        proxy.pause()
        try:
            answers = [await admit(b, "newcomer") for _ in range(5)]
        finally:
            proxy.resume()
        assert [(r.status_code, r.headers.get("llmquota-fallback")) for r in answers] == [
            (201, "local")
        ] * 5, [r.text for r in answers]
        print(
            f"other worker applied: policy {policy_seconds:.3f} s, plan {plan_seconds:.3f} s, "
            f"key deletion {key_seconds:.3f} s, "
            f"after its listener was killed {after_kill_seconds:.3f} s "
            f"(reconnected in {reconnect_seconds:.3f} s)"
        )
