"""Three `llmquota serve` processes on one PostgreSQL admit exactly what the limits allow.

Replicas hold no state of their own: every decision is the database's, so
requests spread over three servers (real subprocesses on distinct ports)
must come out exactly as if one server had taken them all. The refill rates
are one per minute and the test takes seconds, so the bursts are the whole
budget: first a tenant's token bucket binds (the global layer has room),
then the global request bucket binds for another tenant.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator

import asyncpg
import httpx
import pytest

from tests.acceptance.test_cli import _free_port, _wait_healthy

REPLICAS = 3
ADMIN_KEY = "lq_replicas_admin_key_0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
CONCURRENT_CALLERS = 48
# acme: 100 admissions of 100 tokens fit its burst; the global layer admits
# 250 requests in all, so beta gets the 150 acme left.
ACME_ADMISSIONS = 100
GLOBAL_REQUESTS = 250
TOKENS_PER_REQUEST = 100
ATTEMPTS_PER_TENANT = 300
# Refill over the test: 1 request or token a minute, nothing while under a minute.
ONE_PER_MINUTE = 1
MAX_TEST_SECONDS = 60


@pytest.fixture
def servers(database_dsn: str) -> Iterator[list[str]]:
    """Three single-worker servers on one database; their base URLs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMQUOTA_")}
    env.update(
        LLMQUOTA_DATABASE_URL=database_dsn,
        LLMQUOTA_ADMIN_KEY=ADMIN_KEY,
        # A shared 2-core machine: a slow decision must stay a decision, not a 503.
        LLMQUOTA_DECISION_DEADLINE_MS="60000",
        LLMQUOTA_POOL_MAX_SIZE="4",
    )
    ports = [_free_port() for _ in range(REPLICAS)]
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "llmquota.cli", "serve", "--port", str(port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for port in ports
    ]
    try:
        bases = [f"http://127.0.0.1:{port}" for port in ports]
        for base, process in zip(bases, processes, strict=True):
            _wait_healthy(base, process)
        yield bases
    finally:
        for process in processes:
            process.send_signal(signal.SIGTERM)
        # One worker's uvicorn re-raises the SIGTERM once it has shut down gracefully.
        stopped = [
            (process.communicate(timeout=30)[0], process.returncode) for process in processes
        ]
        for output, returncode in stopped:
            assert returncode in (0, -signal.SIGTERM), output
            assert "Application shutdown complete" in output, output


async def _hammer(bases: list[str], tenant: str) -> Counter[tuple[int, str | None]]:
    """ATTEMPTS_PER_TENANT admissions round-robin over the servers, CONCURRENT_CALLERS at once.

    Counts (status, refusing scope)."""
    clients = [httpx.AsyncClient(base_url=base, timeout=60) for base in bases]
    queue = iter(range(ATTEMPTS_PER_TENANT))
    outcomes: Counter[tuple[int, str | None]] = Counter()
    body = {
        "tenant": tenant,
        "model": "gpt-4o",
        "input_tokens": TOKENS_PER_REQUEST // 2,
        "max_tokens": TOKENS_PER_REQUEST // 2,
        "lease_seconds": 300,
    }

    async def caller() -> None:
        for attempt in queue:
            client = clients[attempt % len(clients)]
            response = await client.post("/v1/admit", json=body, headers=ADMIN)
            scope = response.json()["error"]["scope"] if response.status_code == 429 else None
            outcomes[(response.status_code, scope)] += 1

    try:
        await asyncio.gather(*(caller() for _ in range(CONCURRENT_CALLERS)))
    finally:
        for client in clients:
            await client.aclose()
    return outcomes


async def _put(base: str, path: str, policy: dict[str, int]) -> None:
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        response = await client.put(path, json=policy, headers=ADMIN)
        assert response.status_code == 200, response.text


@pytest.mark.slow
async def test_three_servers_admit_exactly_what_the_limits_allow(
    servers: list[str], database_dsn: str
) -> None:
    started = time.monotonic()
    first, second, third = servers
    await _put(
        first,
        "/v1/policies/global",
        {"requests_per_minute": ONE_PER_MINUTE, "request_burst": GLOBAL_REQUESTS},
    )
    await _put(
        second,
        "/v1/tenants/acme/policy",
        {
            "tokens_per_minute": ONE_PER_MINUTE,
            "token_burst": ACME_ADMISSIONS * TOKENS_PER_REQUEST,
        },
    )
    await _put(third, "/v1/tenants/beta/policy", {"tokens_per_minute": 10_000_000})

    acme = await _hammer(servers, "acme")
    assert acme == {
        (201, None): ACME_ADMISSIONS,
        (429, "tenant"): ATTEMPTS_PER_TENANT - ACME_ADMISSIONS,
    }
    beta = await _hammer(servers, "beta")
    assert beta == {
        (201, None): GLOBAL_REQUESTS - ACME_ADMISSIONS,
        (429, "global"): ATTEMPTS_PER_TENANT - (GLOBAL_REQUESTS - ACME_ADMISSIONS),
    }
    # The refill stayed below one request and one admission's tokens.
    assert time.monotonic() - started < MAX_TEST_SECONDS

    connection = await asyncpg.connect(database_dsn)
    try:
        rows = await connection.fetch(
            "SELECT tenant, count(*) AS n, sum(reserved_tokens) AS tokens"
            " FROM reservations WHERE state = 'active' GROUP BY tenant"
        )
    finally:
        await connection.close()
    held = {row["tenant"]: (row["n"], row["tokens"]) for row in rows}
    assert held == {
        "acme": (ACME_ADMISSIONS, ACME_ADMISSIONS * TOKENS_PER_REQUEST),
        "beta": (
            GLOBAL_REQUESTS - ACME_ADMISSIONS,
            (GLOBAL_REQUESTS - ACME_ADMISSIONS) * TOKENS_PER_REQUEST,
        ),
    }
