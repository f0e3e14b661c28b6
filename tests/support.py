"""Helpers shared by the tests (no fixtures here)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import random
import subprocess
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from llmquota.domain.response_cache import unit

if TYPE_CHECKING:
    from fastapi import FastAPI

    from llmquota.admission.limiter import Limiter

APP_ROLE = "llmquota_app"
REPORTING_ROLE = "llmquota_reporting"
CLI_TIMEOUT_SECONDS = 60
ANNOUNCEMENT_TIMEOUT_SECONDS = 10


def dsn_as(dsn: str, user: str) -> str:
    """The same database as another role (the test servers trust local users)."""
    parts = urlsplit(dsn)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}@{host}"))


def run_cli(
    *args: str, dsn: str, env: Mapping[str, str] | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run `llmquota ARGS` as a real subprocess against `dsn`."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("LLMQUOTA_")}
    environment["LLMQUOTA_DATABASE_URL"] = dsn
    environment.update(env or {})
    result = subprocess.run(
        [sys.executable, "-W", "error", "-m", "llmquota.cli", *args],
        capture_output=True,
        text=True,
        env=environment,
        timeout=CLI_TIMEOUT_SECONDS,
        check=False,
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"llmquota {' '.join(args)} exited {result.returncode}\n"
            f"stdout: {result.stdout}\nstderr: {result.stderr}"
        )
    return result


async def queued(limiter: Limiter, tenant: str, waiters: int = 1) -> None:
    """Wait until `tenant` has `waiters` admissions waiting in this worker's queues."""
    for _ in range(200):
        if limiter.waiting.waiting(tenant) == waiters:
            return
        await asyncio.sleep(0.025)
    raise AssertionError(f"{tenant} never had {waiters} waiting")


def vector_at_cosine(vector: list[float], cos: float, rng: random.Random) -> list[float]:
    """A unit vector at cosine `cos` from the unit `vector` (a random direction
    orthogonal to it, mixed in): a paraphrase's embedding, made to measure."""
    noise = [rng.gauss(0.0, 1.0) for _ in vector]
    dot = sum(n * v for n, v in zip(noise, vector, strict=True))
    orthogonal = unit([n - dot * v for n, v in zip(noise, vector, strict=True)])
    sin = math.sqrt(1.0 - cos * cos)
    return [cos * v + sin * o for v, o in zip(vector, orthogonal, strict=True)]


async def announcements_applied(app: FastAPI, dsn: str) -> None:
    """Wait until the app's worker has applied every change announced before now.

    The announcement of a key's creation may reach the worker after the key's
    first use and make it look the key up again at its next one; a test that
    counts lookups, or whose client may not afford one, waits for it first.
    PostgreSQL delivers notifications in commit order, so a marker announced now
    arrives after them; it names a digest no key has. Sent again every half
    second, in case the worker's listener has not connected yet.
    """
    marker = os.urandom(32)
    heard = asyncio.Event()

    def watch(digest: bytes | None) -> None:
        if digest == marker:
            heard.set()

    app.state.limiter.outage.changes.watch_keys(watch)
    db = await asyncpg.connect(dsn)
    try:
        async with asyncio.timeout(ANNOUNCEMENT_TIMEOUT_SECONDS):
            while not heard.is_set():
                await db.execute(
                    "SELECT pg_notify('llmquota_changes', $1)", "api_keys:" + marker.hex()
                )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(heard.wait(), 0.5)
    finally:
        await db.close()


async def fetch_value(dsn: str, query: str) -> object:
    """The first column of the first row `query` returns, on a connection of its own."""
    connection = await asyncpg.connect(dsn)
    try:
        return await connection.fetchval(query)
    finally:
        await connection.close()
