"""A primary with a synchronous streaming standby, from the embedded PostgreSQL's binaries.

The client side of failover needs no orchestrator: a primary, a standby made
with `pg_basebackup -R` that streams from it, and `synchronous_standby_names
= '*'` on the primary once the standby streams, so a commit is acknowledged
only when the standby has flushed it. `fail_over` kills the primary (an
immediate stop: no shutdown checkpoint, backends cut off) and promotes the
standby, which is what an orchestrator (Patroni, pg_auto_failover) does.

The service reaches whichever is primary through one libpq-style URL naming
both hosts with `target_session_attrs=read-write` (`dsn`), the standby first,
so that a client that ignored the attribute would be caught writing to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import asyncpg

from tests.citus.cluster import _prepare_root, _run_as_owner, start_server
from tests.citus.install import Installation, embedded_installation
from tests.ports import reserved_port

START_TIMEOUT_SECONDS = 60
STREAMING_TIMEOUT_SECONDS = 30


@dataclass(frozen=True)
class Server:
    name: str
    port: int
    data: Path

    def dsn_of(self, database: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"


@dataclass
class Pair:
    installation: Installation
    primary: Server
    standby: Server

    def dsn_of(self, database: str) -> str:
        """Both hosts, the standby first; asyncpg connects to the one taking writes."""
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in (self.standby, self.primary))
        return f"postgresql://postgres@{hosts}/{database}?target_session_attrs=read-write"

    def fail_over(self) -> None:
        """Kill the primary and promote the standby (which then takes writes)."""
        _stop(self.installation, self.primary)
        _run_as_owner(
            self.installation, "pg_ctl", "-D", str(self.standby.data), "-w",
            "-t", str(START_TIMEOUT_SECONDS), "promote",
        )  # fmt: skip


def _configure(server: Server) -> None:
    settings = {
        "listen_addresses": "'127.0.0.1'",
        "port": str(server.port),
        "unix_socket_directories": f"'{server.data}'",
        "wal_level": "replica",
        "max_wal_senders": "4",
    }
    with (server.data / "postgresql.conf").open("a") as conf:
        conf.writelines(f"{name} = {value}\n" for name, value in settings.items())


def _start(installation: Installation, server: Server) -> None:
    log = server.data.parent / f"{server.name}.log"
    start_server(installation, server.data, log, f"the {server.name}")


def _stop(installation: Installation, server: Server) -> None:
    with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
        _run_as_owner(installation, "pg_ctl", "-D", str(server.data), "-m", "immediate", "stop")


async def _make_synchronous(primary: Server) -> None:
    """Once the standby streams: every commit waits for the standby's flush."""
    connection = await asyncpg.connect(primary.dsn_of("postgres"))
    try:
        deadline = time.monotonic() + STREAMING_TIMEOUT_SECONDS
        while not await connection.fetchval(
            "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'"
        ):
            if time.monotonic() > deadline:
                raise RuntimeError("the standby never streamed from the primary")
            await asyncio.sleep(0.1)
        await connection.execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
        await connection.execute("SELECT pg_reload_conf()")
        while (
            await connection.fetchval(
                "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'"
            )
            == 0
        ):
            if time.monotonic() > deadline:
                raise RuntimeError("the standby never became synchronous")
            await asyncio.sleep(0.1)
    finally:
        await connection.close()


@contextlib.contextmanager
def primary_and_standby(root: Path) -> Iterator[Pair]:
    """Start a primary and its synchronous standby under `root`; stop both on leaving."""
    installation = embedded_installation()
    root.mkdir(parents=True, exist_ok=True)
    _prepare_root(root)
    pair = Pair(
        installation,
        primary=Server("primary", reserved_port(), root / "primary"),
        standby=Server("standby", reserved_port(), root / "standby"),
    )
    started: list[Server] = []
    try:
        _run_as_owner(
            installation, "initdb", "-D", str(pair.primary.data), "-U", "postgres",
            "--auth=trust", "-E", "UTF8",
        )  # fmt: skip
        _configure(pair.primary)
        started.append(pair.primary)
        _start(installation, pair.primary)
        _run_as_owner(
            installation, "pg_basebackup", "-h", "127.0.0.1", "-p", str(pair.primary.port),
            "-U", "postgres", "-D", str(pair.standby.data), "-R", "-X", "stream", "-c", "fast",
        )  # fmt: skip
        _configure(pair.standby)
        started.append(pair.standby)
        _start(installation, pair.standby)
        asyncio.run(_make_synchronous(pair.primary))
        yield pair
    finally:
        for server in started:
            _stop(installation, server)
