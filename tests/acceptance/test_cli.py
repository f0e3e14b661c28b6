"""The real `llmquota` command, run as a subprocess against a real PostgreSQL."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import asyncpg
import httpx
import psutil
import pytest

from tests.conftest import _admin, dsn_with_database
from tests.ports import reserved_port

LLMQUOTA = [sys.executable, "-m", "llmquota.cli"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMQUOTA_")}
    env.update(extra)
    return env


async def _fetchval(dsn: str, query: str) -> object:
    connection = await asyncpg.connect(dsn)
    try:
        return await connection.fetchval(query)
    finally:
        await connection.close()


def _free_port() -> int:
    return reserved_port()


def _wait_healthy(base: str, process: subprocess.Popen[str], seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"serve exited: {process.stdout.read() if process.stdout else ''}")
        try:
            if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("serve did not become healthy")


def test_tokens_counts_stdin() -> None:
    result = subprocess.run(
        [*LLMQUOTA, "tokens", "--model", "gpt-4o"],
        input="hello world",
        capture_output=True,
        text=True,
        check=True,
        env=_env(),
    )
    assert result.stdout.strip() == "2 (o200k_base)"
    estimated = subprocess.run(
        [*LLMQUOTA, "tokens", "--model", "claude-3-5-sonnet"],
        input="hello world",
        capture_output=True,
        text=True,
        check=True,
        env=_env(),
    )
    assert estimated.stdout.strip() == "3 (estimated, o200k_base)"  # ceil(2 x 1.25)


def test_help_shows_environment_fallbacks() -> None:
    result = subprocess.run(
        [*LLMQUOTA, "serve", "--help"], capture_output=True, text=True, check=True, env=_env()
    )
    for variable in ("LLMQUOTA_HOST", "LLMQUOTA_PORT", "LLMQUOTA_WORKERS"):
        assert variable in result.stdout


def test_migrate_serve_admit_and_sweep(server_dsn: str) -> None:
    name = f"llmquota_cli_{os.getpid()}"
    asyncio.run(
        _admin(server_dsn, f'DROP DATABASE IF EXISTS "{name}"', f'CREATE DATABASE "{name}"')
    )
    dsn = dsn_with_database(server_dsn, name)
    # The cron way: serve's own sweeper (on by default) is off, so that the
    # `sweep` below finds the three lapsed reservations.
    env = _env(
        LLMQUOTA_DATABASE_URL=dsn, LLMQUOTA_ADMIN_KEY="lq_cli_admin", LLMQUOTA_SERVE_SWEEPER="false"
    )
    try:
        subprocess.run([*LLMQUOTA, "migrate"], check=True, env=env, capture_output=True)
        assert asyncio.run(_fetchval(dsn, "SELECT version_num FROM alembic_version"))

        port = _free_port()
        base = f"http://127.0.0.1:{port}"
        serve = subprocess.Popen(
            [*LLMQUOTA, "serve", "--port", str(port), "--workers", "2"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            _wait_healthy(base, serve)
            admin = {"Authorization": "Bearer lq_cli_admin"}
            with httpx.Client(base_url=base) as client:
                put = client.put(
                    "/v1/tenants/acme/policy",
                    json={"tokens_per_minute": 60, "token_burst": 1_000, "max_in_flight": 5},
                    headers=admin,
                )
                assert put.status_code == 200
                for _ in range(3):
                    response = client.post(
                        "/v1/admit",
                        json={
                            "tenant": "acme",
                            "model": "gpt-4o",
                            "input_tokens": 100,
                            "max_tokens": 100,
                            "lease_seconds": 1,
                        },
                        headers=admin,
                    )
                    assert response.status_code == 201
            time.sleep(1.2)
            swept = subprocess.run(
                [*LLMQUOTA, "sweep"], check=True, env=env, capture_output=True, text=True
            )
            assert "expired=3 tokens_returned=600" in swept.stdout
            # A command prints only its output: no log lines, on either stream.
            assert swept.stderr == "", swept.stderr
            assert len(swept.stdout.splitlines()) == 1, swept.stdout
        finally:
            serve.send_signal(signal.SIGTERM)
            output, _ = serve.communicate(timeout=30)
            assert serve.returncode == 0, output
    finally:
        asyncio.run(_admin(server_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def _postgres_for(data_dir: Path) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["name", "cmdline"]):
        cmdline = process.info.get("cmdline") or []
        if process.info.get("name") == "postgres" and str(data_dir) in " ".join(cmdline):
            found.append(process)
    return found


@pytest.mark.slow
def test_serve_on_embedded_database_shares_it_and_leaves_no_orphan(tmp_path: Path) -> None:
    data_dir = tmp_path / "pgdata"
    env = _env(LLMQUOTA_DATA_DIR=str(data_dir))
    port = _free_port()
    serve = subprocess.Popen(
        [*LLMQUOTA, "serve", "--port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", serve)
        servers = _postgres_for(data_dir)
        assert servers, "serve started no embedded PostgreSQL"
        postmaster = min(servers, key=lambda p: p.create_time()).pid
        # A sweep while serve is up joins the same server and leaves it running.
        swept = subprocess.run(
            [*LLMQUOTA, "sweep"], env=env, capture_output=True, text=True, timeout=60, check=False
        )
        assert swept.returncode == 0, swept.stdout + swept.stderr
        assert "expired=0" in swept.stdout
        assert postmaster in {p.pid for p in _postgres_for(data_dir)}
    finally:
        serve.send_signal(signal.SIGINT)
        output, _ = serve.communicate(timeout=60)
    assert "Generated the admin API key" in output
    deadline = time.monotonic() + 15
    while _postgres_for(data_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _postgres_for(data_dir) == []


def test_a_command_prints_only_its_output_unless_verbose(tmp_path: Path) -> None:
    """On the embedded database a command used to print its INFO lines (the
    server it started) before its output; now only --verbose shows them, on stderr."""
    env = _env(LLMQUOTA_DATA_DIR=str(tmp_path / "data"))
    subprocess.run([*LLMQUOTA, "migrate"], check=True, env=env, capture_output=True)
    quiet = subprocess.run(
        [*LLMQUOTA, "sweep"], check=True, env=env, capture_output=True, text=True
    )
    assert quiet.stderr == "", quiet.stderr
    assert quiet.stdout.startswith("swept: expired=0 ") and len(quiet.stdout.splitlines()) == 1
    verbose = subprocess.run(
        [*LLMQUOTA, "--verbose", "sweep"], check=True, env=env, capture_output=True, text=True
    )
    assert "INFO llmquota.store.database: using embedded PostgreSQL" in verbose.stderr
    assert verbose.stdout.startswith("swept: expired=0 ") and "INFO" not in verbose.stdout
