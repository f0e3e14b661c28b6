"""Debian's PgBouncer in transaction pooling, started in front of a test database.

The test writes its own configuration into a temporary directory, listens on
a free loopback port, and authenticates clients with SCRAM against a user
list of its own (the test server behind it trusts local users). It serves
fewer server connections than the application opens, so sessions really are
shared between clients, as in production.

PgBouncer is not optional in CI: `.ci/run` installs it. A machine without it
fails the tests that need it, with the command that installs it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
MISSING = (
    "pgbouncer is not installed: run .ci/run (it installs Debian's pgbouncer) "
    "or `apt-get install pgbouncer`"
)
PASSWORD = "bouncer-test-secret"
# Server connections per database and user: fewer than the application's pool,
# so one client's statements land on several server sessions.
SERVER_POOL_SIZE = 2
START_TIMEOUT_SECONDS = 20.0


@dataclass(frozen=True)
class Bouncer:
    """A running PgBouncer: the DSN clients use, and its version line."""

    dsn: str
    version: str


@dataclass(frozen=True)
class _Target:
    host: str
    port: int
    database: str
    user: str


def _target(dsn: str) -> _Target:
    """Where the test database is, from a DSN of either form the fixtures produce."""
    parts = urlsplit(dsn)
    query = parse_qs(parts.query)
    host = query.get("host", [parts.hostname or "127.0.0.1"])[0]
    port = int(query.get("port", [parts.port or 5432])[0])
    return _Target(
        host=unquote(host),
        port=port,
        database=parts.path.lstrip("/"),
        user=parts.username or "postgres",
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _run_as(target: _Target) -> str | None:
    """PgBouncer refuses to run as root; then it runs as whoever owns the socket directory
    (it must reach the server's socket) or as postgres for a server on TCP."""
    if os.geteuid() != 0:
        return None
    if target.host.startswith("/"):
        return Path(target.host).owner()
    return "postgres"


def _config(target: _Target, work: Path, port: int) -> str:
    return "\n".join(
        [
            "[databases]",
            f"{target.database} = host={target.host} port={target.port} "
            f"dbname={target.database} user={target.user}",
            "[pgbouncer]",
            "listen_addr = 127.0.0.1",
            f"listen_port = {port}",
            "unix_socket_dir =",
            "auth_type = scram-sha-256",
            f"auth_file = {work / 'userlist.txt'}",
            "pool_mode = transaction",
            f"default_pool_size = {SERVER_POOL_SIZE}",
            "max_client_conn = 200",
            # Debian's 1.18 has no max_prepared_statements (1.21+): the
            # application runs with LLMQUOTA_TRANSACTION_POOLER instead.
            f"logfile = {work / 'pgbouncer.log'}",
            f"pidfile = {work / 'pgbouncer.pid'}",
            "",
        ]
    )


def _wait_listening(process: subprocess.Popen[bytes], port: int, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            text = log.read_text() if log.exists() else ""
            raise AssertionError(f"pgbouncer exited {process.returncode}: {text[-2_000:]}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.05)
    raise AssertionError(f"pgbouncer did not listen on {port} in {START_TIMEOUT_SECONDS} s")


@contextlib.contextmanager
def pgbouncer(database_dsn: str) -> Iterator[Bouncer]:
    """PgBouncer in transaction pooling in front of `database_dsn`'s database."""
    if not Path(PGBOUNCER).exists():
        pytest.fail(MISSING, pytrace=False)
    target = _target(database_dsn)
    work = Path(tempfile.mkdtemp(prefix="llmquota-pgbouncer-"))
    user = _run_as(target)
    port = _free_port()
    (work / "userlist.txt").write_text(f'"{target.user}" "{PASSWORD}"\n')
    (work / "pgbouncer.ini").write_text(_config(target, work, port))
    if user is not None:
        for path in (work, *work.iterdir()):
            shutil.chown(path, user)
    version = subprocess.run(
        [PGBOUNCER, "--version"], capture_output=True, text=True, check=True
    ).stdout.splitlines()[0]
    process = subprocess.Popen(
        [PGBOUNCER, str(work / "pgbouncer.ini")],
        user=user,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_listening(process, port, work / "pgbouncer.log")
        yield Bouncer(
            dsn=f"postgresql://{target.user}:{PASSWORD}@127.0.0.1:{port}/{target.database}",
            version=version,
        )
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        shutil.rmtree(work, ignore_errors=True)
