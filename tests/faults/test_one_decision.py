"""One decision per request: what a failure mode answered never also lands in the database.

A real server subprocess reaches PostgreSQL through a proxy the test
controls; under load, `freeze()` makes the database a stopped server
(nothing it is sent is read, nothing lost: at `thaw()` every statement sent
meanwhile runs, and answers travel back). Every admission the worker gave
up on at its deadline was answered by `open` or `local`; the statements it
had sent must then write nothing (lq_admit refuses past its deadline), and
those that committed before the freeze, whose answers never arrived, must
be released once the database answers again (admission/abandoned.py). So
after the freeze, every active reservation is one the client holds, and
once the client releases them all, every balance is back where it started:
tokens, requests, permits, the quota window and the prepaid credits.
"""

from __future__ import annotations

import asyncio
import time
from decimal import Decimal
from pathlib import Path

import asyncpg
import httpx

from tests.faults.conftest import metric_value, serving_process
from tests.faults.proxy import PgProxy

ADMIN_KEY = "lq_one_decision_admin_key_0123"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
TOKEN_BURST = 10_000_000
REQUEST_BURST = 1_000_000
CREDITS = Decimal("1000.00")
CLIENTS_PER_TENANT = 8
BEFORE_SECONDS = 1.0
FROZEN_SECONDS = 2.0
AFTER_SECONDS = 1.5
# Leases far longer than the test: nothing it counts can be an expiry's doing.
LEASE_SECONDS = 600
# Time the worker may take after the thaw to record its journal and release
# what it abandoned (probes every 0.1 s).
CONVERGE_SECONDS = 20.0
# (tenant, failure mode, prepaid with a quota): one of each mode that admits
# during an outage; the plain one is decided by lq_admit's set-based fast
# path, the prepaid one (credits, a quota) by its exact loop.
TENANTS = (("frozen-open", "open", False), ("frozen-local", "local", True))


def policy(mode: str, prepaid: bool) -> dict[str, object]:
    # Refill of 1 token and 1/60 request a second: a reservation left behind
    # (110 tokens, one request) cannot be refilled away during the test.
    return {
        "tokens_per_minute": 60,
        "token_burst": TOKEN_BURST,
        "requests_per_minute": 1,
        "request_burst": REQUEST_BURST,
        "max_in_flight": 100_000,
        "failure_mode": mode,
        "lease_seconds": LEASE_SECONDS,
        "prepaid": prepaid,
    }


async def setup_tenant(
    client: httpx.AsyncClient, tenant: str, mode: str, prepaid: bool
) -> dict[str, str]:
    """Policy (with a quota and credits when prepaid) and a key the worker has used."""
    r = await client.put(f"/v1/tenants/{tenant}/policy", json=policy(mode, prepaid), headers=ADMIN)
    assert r.status_code == 200, r.text
    if prepaid:
        await fund(client, tenant)
    r = await client.post(f"/v1/tenants/{tenant}/keys", headers=ADMIN)
    assert r.status_code == 201, r.text
    headers = {"Authorization": f"Bearer {r.json()['key']}"}
    assert (await client.get(f"/v1/tenants/{tenant}/status", headers=headers)).status_code == 200
    return headers


async def fund(client: httpx.AsyncClient, tenant: str) -> None:
    """A monthly token quota and prepaid credits."""
    r = await client.put(
        f"/v1/tenants/{tenant}/quotas/monthly",
        json={"period": "month", "timezone": "UTC", "tokens": 1_000_000_000},
        headers=ADMIN,
    )
    assert r.status_code in (200, 201), r.text
    r = await client.post(
        f"/v1/tenants/{tenant}/credits",
        json={"amount": str(CREDITS), "reference": "opening"},
        headers=ADMIN,
    )
    assert r.status_code == 201, r.text


async def load(
    client: httpx.AsyncClient,
    tenant: str,
    *,
    headers: dict[str, str],
    held: set[str],
    answers: dict[str, int],
    stop: asyncio.Event,
) -> None:
    """Admit until told to stop; keep every reservation id an answer gave."""
    body = {
        "tenant": tenant,
        "model": "gpt-4o",
        "input_tokens": 10,
        "max_tokens": 100,
        "lease_seconds": LEASE_SECONDS,
    }
    while not stop.is_set():
        try:
            r = await client.post("/v1/admit", json=body, headers=headers)
        except httpx.TransportError:
            answers["transport_error"] = answers.get("transport_error", 0) + 1
            continue
        kind = f"{r.status_code} {r.headers.get('llmquota-fallback', 'store')}"
        answers[kind] = answers.get(kind, 0) + 1
        if r.status_code == 201:
            held.add(r.json()["reservation_id"])


async def active_ids(db: asyncpg.Connection) -> set[str]:
    rows = await db.fetch(
        "SELECT reservation_id::text AS id FROM reservations WHERE state = 'active'"
    )
    return {row["id"] for row in rows}


async def test_no_reservation_without_a_holder_after_a_freeze_under_load(
    proxy: PgProxy, db: asyncpg.Connection, tmp_path: Path
) -> None:
    await db.execute(
        "INSERT INTO model_prices VALUES ('gpt-4o', '2020-01-01', 2.5, 10) ON CONFLICT DO NOTHING"
    )
    async with (
        serving_process(
            proxy.dsn,
            ADMIN_KEY,
            tmp_path / "server.log",
            decision_deadline_ms="250",
            outage_probe_seconds="0.1",
        ) as base,
        httpx.AsyncClient(base_url=base, timeout=30) as client,
    ):
        keys = {
            tenant: await setup_tenant(client, tenant, mode, prepaid)
            for tenant, mode, prepaid in TENANTS
        }
        held: set[str] = set()
        answers: dict[str, int] = {}
        stop = asyncio.Event()
        clients = [
            asyncio.create_task(
                load(client, tenant, headers=keys[tenant], held=held, answers=answers, stop=stop)
            )
            for tenant, _, _ in TENANTS
            for _ in range(CLIENTS_PER_TENANT)
        ]
        await asyncio.sleep(BEFORE_SECONDS)
        proxy.freeze()
        await asyncio.sleep(FROZEN_SECONDS)
        proxy.thaw()
        thawed = time.monotonic()
        await asyncio.sleep(AFTER_SECONDS)
        stop.set()
        await asyncio.gather(*clients)

        # Every active reservation is one the client holds, and every one it
        # holds is recorded (the outage admissions too), within the bound.
        while True:
            active = await active_ids(db)
            if active == held or time.monotonic() - thawed > CONVERGE_SECONDS:
                break
            await asyncio.sleep(0.1)
        converged_seconds = time.monotonic() - thawed
        metrics = (await client.get("/metrics")).text
        released = metric_value(metrics, "llmquota_abandoned_admissions_released_total")
        print(
            f"answers {answers}; held {len(held)}; abandoned and released {released:.0f}; "
            f"converged {converged_seconds:.2f} s after the thaw"
        )
        assert answers.get("201 store", 0) > 0 and (
            answers.get("201 open", 0) + answers.get("201 local", 0) > 0
        ), answers
        holderless = active - held
        assert len(holderless) == 0, f"{len(holderless)} reservations nobody holds"
        assert held <= active, f"{len(held - active)} held reservations not recorded"

        # Give everything back through the server; then nothing may be kept.
        tenant_of = {
            row["id"]: row["tenant"]
            for row in await db.fetch(
                "SELECT reservation_id::text AS id, tenant FROM reservations WHERE state = 'active'"
            )
        }
        pending = sorted(held)
        for _ in range(20):  # a 503 (a release past the 250 ms deadline) is retried
            results = []
            for start in range(0, len(pending), 50):
                results += await asyncio.gather(
                    *(
                        client.post(f"/v1/reservations/{rid}/release", headers=keys[tenant_of[rid]])
                        for rid in pending[start : start + 50]
                    )
                )
            assert {r.status_code for r in results} <= {200, 503}, [r.text for r in results]
            pending = [rid for rid, r in zip(pending, results, strict=True) if r.status_code != 200]
            if not pending:
                break
            await asyncio.sleep(0.2)
        assert pending == []

    assert await active_ids(db) == set()
    for tenant, _, prepaid in TENANTS:
        row = await db.fetchrow(
            """SELECT tokens, requests, in_flight FROM limit_layers
                WHERE scope = 'tenant' AND tenant = $1""",
            tenant,
        )
        assert row is not None
        assert (row["tokens"], row["requests"], row["in_flight"]) == (
            TOKEN_BURST,
            REQUEST_BURST,
            0,
        ), tenant
        if not prepaid:
            continue
        quota = await db.fetchrow(
            """SELECT coalesce(sum(reserved_tokens), 0) AS tokens,
                      coalesce(sum(reserved_cost), 0) AS cost
                 FROM quota_windows WHERE tenant = $1""",
            tenant,
        )
        assert quota is not None and (quota["tokens"], quota["cost"]) == (0, 0), tenant
        credit = await db.fetchrow(
            "SELECT balance, reserved FROM credit_accounts WHERE tenant = $1", tenant
        )
        assert credit is not None and (credit["balance"], credit["reserved"]) == (CREDITS, 0)
