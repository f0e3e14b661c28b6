"""Fixtures for the fault tests: a hangable proxy, helpers, and the audit.

Every fault test ends with `lq_audit()` on its database (the autouse
`audited` fixture of tests/conftest.py): whatever the fault did, the
counters must still agree with the journal.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from llmquota.admission.limiter import Limiter
from llmquota.api.app import create_app
from llmquota.config import Settings
from llmquota.domain.policy import Policy
from llmquota.domain.vocabulary import Scope
from tests.faults.proxy import PgProxy
from tests.ports import reserved_port

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
WORKER = str(Path(__file__).with_name("worker.py"))


def fault_settings(**overrides: Any) -> Settings:
    """Settings for a limiter under test; `overrides` are Settings fields."""
    values: dict[str, Any] = {
        "pool_min_size": 1,
        "pool_max_size": 10,
        # Long enough that a busy shared machine does not time a healthy
        # store out; the tests that prove the 250 ms default set it.
        "decision_deadline_ms": 1_000,
        "outage_probe_seconds": 0.1,
    }
    values.update(overrides)
    return Settings(_env_file=None, **values)  # type: ignore[call-arg]


@pytest.fixture
async def proxy(database_dsn: str) -> AsyncIterator[PgProxy]:
    """A proxy to the test database that the test can hang or cut."""
    p = await PgProxy(database_dsn).start()
    yield p
    await p.close()


async def put(
    limiter: Limiter,
    scope: Scope,
    tenant: str | None = None,
    route: str | None = None,
    **policy: Any,
) -> None:
    """Create or replace one layer's policy."""
    await limiter.store.put_policy(scope, tenant, route, Policy(**policy))


async def count(db: asyncpg.Connection, table: str, where: str = "true", *args: Any) -> int:
    return int(await db.fetchval(f"SELECT count(*) FROM {table} WHERE {where}", *args))


async def layer(db: asyncpg.Connection, tenant: str | None) -> asyncpg.Record:
    """The stored row of a tenant layer (or the global one for None)."""
    row = await db.fetchrow(
        """SELECT tokens, requests, in_flight, refilled_at FROM limit_layers
            WHERE tenant IS NOT DISTINCT FROM $1 AND route IS NULL""",
        tenant,
    )
    assert row is not None
    return row


def elapsed_since(started: float) -> float:
    return time.perf_counter() - started


def worker_env(**extra: str) -> dict[str, str]:
    """The environment of a worker subprocess: this one, with the repo importable."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


class Worker:
    """A worker subprocess (tests/faults/worker.py) spoken to in JSON lines."""

    def __init__(self, process: Any) -> None:
        self.process = process

    @classmethod
    async def start(cls, dsn: str, *, prefix: list[str] | None = None, **env: str) -> Worker:
        process = await asyncio.create_subprocess_exec(
            *(prefix or []),
            PYTHON,
            WORKER,
            dsn,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=worker_env(**env),
        )
        worker = cls(process)
        ready = await worker.read()
        assert ready.get("ready") is True, ready
        return worker

    @property
    def pid(self) -> int:
        return int(self.process.pid)

    async def read(self, wait_seconds: float = 60.0) -> dict[str, Any]:
        line = await asyncio.wait_for(self.process.stdout.readline(), wait_seconds)
        if not line:
            raise RuntimeError("worker exited")
        result: dict[str, Any] = json.loads(line)
        return result

    def send(self, **command: Any) -> None:
        self.process.stdin.write((json.dumps(command) + "\n").encode())

    async def call(self, **command: Any) -> dict[str, Any]:
        self.send(**command)
        return await self.read()

    async def stop(self) -> None:
        if self.process.returncode is None:
            with contextlib.suppress(Exception):
                self.send(op="exit")
                await asyncio.wait_for(self.process.wait(), 15)
        if self.process.returncode is None:
            self.process.kill()
            await self.process.wait()


@contextlib.asynccontextmanager
async def serving(settings: Settings, dsn: str) -> AsyncIterator[tuple[str, FastAPI]]:
    """A real uvicorn server in this process on a free loopback port: (base URL, app)."""
    app = create_app(settings, dsn=dsn)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        assert not task.done(), "uvicorn did not start"
        await asyncio.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        await task


def metric_value(exposition: str, name: str, **labels: str) -> float:
    """One sample of a Prometheus text exposition (GET /metrics); 0 when absent."""
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def free_port() -> int:
    """A port for a server of the test's own (held for the session: tests/ports.py)."""
    return reserved_port()


@contextlib.asynccontextmanager
async def serving_process(
    dsn: str, admin_key: str, log: Path, **settings: str
) -> AsyncIterator[str]:
    """`uvicorn --factory create_app_from_env` as a subprocess, as in production; its URL.

    `settings` are more variables, which win: LLMQUOTA_* names as they are,
    other names as settings fields (prefixed and upper-cased)."""
    async with served_process(dsn, admin_key, log, **settings) as (base, _pid):
        yield base


@contextlib.asynccontextmanager
async def served_process(
    dsn: str, admin_key: str, log: Path, **settings: str
) -> AsyncIterator[tuple[str, int]]:
    """serving_process, yielding (URL, pid)."""
    port = free_port()
    variables = {
        "LLMQUOTA_DATABASE_URL": dsn,
        "LLMQUOTA_ADMIN_KEY": admin_key,
        # Unless told otherwise: a busy machine must not turn a slow answer into a 503.
        "LLMQUOTA_DECISION_DEADLINE_MS": "5000",
    }
    variables.update(
        {
            name if name.startswith("LLMQUOTA_") else f"LLMQUOTA_{name.upper()}": value
            for name, value in settings.items()
        }
    )
    env = worker_env(**variables)
    with log.open("wb") as errors:
        process = await asyncio.create_subprocess_exec(
            *(PYTHON, "-m", "uvicorn", "--factory", "llmquota.api.app:create_app_from_env"),
            *("--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"),
            env=env,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=errors,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=base) as probe:
            deadline = time.monotonic() + 30
            while True:
                if process.returncode is not None:
                    raise AssertionError(await asyncio.to_thread(log.read_text))
                assert time.monotonic() < deadline, "the server did not start"
                try:
                    if (await probe.get("/healthz")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.1)
        yield base, process.pid
    finally:
        with contextlib.suppress(ProcessLookupError):  # the test may have killed it
            process.terminate()
        await process.wait()


@contextlib.asynccontextmanager
async def port_of_process(module: str, *args: str) -> AsyncIterator[int]:
    """`python -m module args...` as a process of its own that prints the port it
    listens on as its first line (a misbehaving peer of a fault test); that port.
    Killed at the end of the block."""
    process = await asyncio.create_subprocess_exec(
        PYTHON,
        "-m",
        module,
        *args,
        cwd=str(REPO),
        env=worker_env(),
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        yield int(await asyncio.wait_for(process.stdout.readline(), 30))
    finally:
        process.kill()
        await process.wait()


async def timed(call: Awaitable[httpx.Response]) -> tuple[httpx.Response, float]:
    """A response and the seconds it took."""
    started = time.perf_counter()
    response = await call
    return response, time.perf_counter() - started


async def wait_for(condition: Callable[[], Awaitable[bool]], seconds: float) -> None:
    """Poll `condition` until it holds; fail after `seconds`."""
    deadline = time.monotonic() + seconds
    while not await condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.05)
