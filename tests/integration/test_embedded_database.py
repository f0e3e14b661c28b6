"""The embedded PostgreSQL is shared by the commands using one data directory
and stopped when the last of them exits, however it exits.

Real processes and a real server: each test starts `python -c` children that
open the database, and checks the postmaster with psutil afterwards.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import psutil
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from llmquota.config import DATA_DIR_ENV, DATABASE_URL_ENV, Settings
from llmquota.store.database import default_data_dir, open_database, sqlalchemy_url

# A command using the database: opens it, reports, waits for a line on stdin
# (or EOF) and leaves. With "uvicorn" it serves on a unix socket instead, the
# way `llmquota serve` does.
CHILD = r"""
import asyncio, json, os, sys
import asyncpg
from llmquota.store.database import open_database

async def start_time(dsn):
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchval("select extract(epoch from pg_postmaster_start_time())::float8")
    finally:
        await conn.close()

data_dir, mode = sys.argv[1], sys.argv[2]
with open_database(data_dir=data_dir) as db:
    postmaster_pid = int((db.data_dir / "postmaster.pid").read_text().split()[0])
    report = {"pid": os.getpid(), "dsn": db.dsn, "postmaster_pid": postmaster_pid,
              "start_time": asyncio.run(start_time(db.dsn))}
    print(json.dumps(report), flush=True)
    if mode == "uvicorn":
        import uvicorn

        async def app(scope, receive, send):
            pass

        config = uvicorn.Config(app, uds=sys.argv[3], lifespan="off", log_level="warning")
        uvicorn.Server(config).run()
    else:
        sys.stdin.readline()
print("released", flush=True)
"""

STARTUP_TIMEOUT = 30.0
STOP_TIMEOUT = 10.0


class Child:
    """A child process holding the database, with what it reported."""

    def __init__(self, pgdata: Path, *args: str, new_session: bool = False) -> None:
        env = {k: v for k, v in os.environ.items() if k != DATABASE_URL_ENV}
        self.process = subprocess.Popen(
            [sys.executable, "-W", "error", "-c", CHILD, str(pgdata), *(args or ("wait",))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=new_session,
        )
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], STARTUP_TIMEOUT)
        line = self.process.stdout.readline() if ready else ""
        if not line:
            self.process.kill()
            _, err = self.process.communicate()
            pytest.fail(f"child did not report: rc={self.process.returncode} stderr={err}")
        self.report: dict[str, Any] = json.loads(line)
        self.pid: int = self.report["pid"]
        self.postmaster_pid: int = self.report["postmaster_pid"]

    def finish(self) -> int:
        """Ask the child to leave (newline on stdin) and wait for it."""
        assert self.process.stdin is not None
        self.process.stdin.write("\n")
        self.process.stdin.flush()
        return self.wait()

    def wait(self) -> int:
        out, err = self.process.communicate(timeout=STOP_TIMEOUT + 20)
        self.stdout, self.stderr = out, err
        return self.process.returncode


def postmasters(pgdata: Path) -> list[int]:
    """Pids of live (non-zombie) postgres processes started on pgdata."""
    found = []
    for proc in psutil.process_iter(["pid", "name", "cmdline", "status"]):
        info = proc.info
        if info["status"] == psutil.STATUS_ZOMBIE or info["name"] != "postgres":
            continue
        if str(pgdata) in (info["cmdline"] or []):
            found.append(info["pid"])
    return found


def wait_for_no_postmaster(pgdata: Path, timeout: float = STOP_TIMEOUT) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := postmasters(pgdata)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def users_register(pgdata: Path) -> dict[str, float]:
    register: dict[str, float] = json.loads((pgdata / ".llmquota-users.json").read_text())
    return register


async def postmaster_start_time(dsn: str) -> float:
    conn = await asyncpg.connect(dsn)
    try:
        value = await conn.fetchval("select extract(epoch from pg_postmaster_start_time())::float8")
        return float(value)
    finally:
        await conn.close()


@pytest.fixture
def pgdata(tmp_path: Path) -> Iterator[Path]:
    """A fresh data directory; whatever a failed test leaves running is stopped."""
    path = tmp_path / "data" / "pgdata"  # the parent does not exist yet
    children_before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield path
    for child in psutil.Process().children(recursive=True):
        if child.pid not in children_before:
            child.kill()
    for pid in postmasters(path):
        psutil.Process(pid).kill()


@pytest.fixture(autouse=True)
def _no_configured_database(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about the embedded server: a configured URL (CI's
    PostgreSQL 15 leg sets one) would win over the data directory."""
    monkeypatch.delenv(DATABASE_URL_ENV, raising=False)


def test_two_processes_share_one_server_and_the_last_stops_it(pgdata: Path) -> None:
    first = Child(pgdata)
    second = Child(pgdata)

    assert second.postmaster_pid == first.postmaster_pid
    assert second.report["start_time"] == first.report["start_time"]
    assert (
        second.report["dsn"]
        == first.report["dsn"]
        == f"postgresql://postgres@/postgres?host={pgdata}"
    )
    assert postmasters(pgdata) == [first.postmaster_pid]
    assert set(users_register(pgdata)) == {str(first.pid), str(second.pid)}

    assert second.finish() == 0
    # The first still holds it: same server, still answering.
    assert postmasters(pgdata) == [first.postmaster_pid]
    assert set(users_register(pgdata)) == {str(first.pid)}
    assert asyncio.run(postmaster_start_time(first.report["dsn"])) == first.report["start_time"]

    assert first.finish() == 0
    assert first.stdout.strip() == "released"
    assert wait_for_no_postmaster(pgdata) == []
    assert not psutil.pid_exists(first.postmaster_pid) or (
        psutil.Process(first.postmaster_pid).status() == psutil.STATUS_ZOMBIE
    )
    assert users_register(pgdata) == {}


def test_sigterm_to_the_last_user_stops_the_server(pgdata: Path) -> None:
    first = Child(pgdata)
    second = Child(pgdata)
    assert second.postmaster_pid == first.postmaster_pid

    second.process.send_signal(signal.SIGTERM)
    assert second.wait() == 128 + signal.SIGTERM  # SystemExit from our handler, not a kill
    assert postmasters(pgdata) == [first.postmaster_pid]
    assert set(users_register(pgdata)) == {str(first.pid)}

    first.process.send_signal(signal.SIGTERM)
    assert first.wait() == 128 + signal.SIGTERM
    assert wait_for_no_postmaster(pgdata) == []


def test_ctrl_c_stops_the_server(pgdata: Path) -> None:
    # Ctrl-C signals the terminal's whole foreground process group; the child
    # leads its own group here, as a command typed into a shell would.
    child = Child(pgdata, new_session=True)
    assert postmasters(pgdata) == [child.postmaster_pid]
    # pg_ctl put the server in a session of its own, so Ctrl-C does not reach it.
    assert os.getsid(child.postmaster_pid) != os.getsid(child.pid)

    os.killpg(child.pid, signal.SIGINT)
    assert child.wait() == -signal.SIGINT  # Python re-raises an uncaught KeyboardInterrupt
    assert "KeyboardInterrupt" in child.stderr
    assert wait_for_no_postmaster(pgdata) == []


def test_sigterm_during_startup_is_held_until_the_server_can_be_released(pgdata: Path) -> None:
    # Between starting the server and registering as its user, an exit would
    # orphan the server; open_database holds such a signal back and acts on
    # it once the use is recorded, which stops the just-started server.
    env = {k: v for k, v in os.environ.items() if k != DATABASE_URL_ENV}
    child = subprocess.Popen(
        [sys.executable, "-W", "error", "-c", CHILD, str(pgdata), "wait"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while not pgdata.exists() and time.monotonic() < deadline:  # initdb is starting
        time.sleep(0.005)
    assert pgdata.exists()
    child.send_signal(signal.SIGTERM)
    out, err = child.communicate(timeout=STARTUP_TIMEOUT)

    assert child.returncode == 128 + signal.SIGTERM, err
    assert out == ""  # it never got to use the database
    log = (pgdata / "log").read_text()
    assert "database system is ready to accept connections" in log
    assert "database system is shut down" in log
    assert wait_for_no_postmaster(pgdata) == []
    assert users_register(pgdata) == {}


def test_kill_9_of_one_user_does_not_keep_the_server_alive(pgdata: Path) -> None:
    killed = Child(pgdata)
    survivor = Child(pgdata)
    assert survivor.postmaster_pid == killed.postmaster_pid

    killed.process.kill()
    assert killed.wait() == -signal.SIGKILL
    # No cleanup ran for it: it is still in the register, and the server is up.
    assert set(users_register(pgdata)) == {str(killed.pid), str(survivor.pid)}
    assert postmasters(pgdata) == [survivor.postmaster_pid]

    assert survivor.finish() == 0
    assert wait_for_no_postmaster(pgdata) == []
    assert users_register(pgdata) == {}


def test_a_server_orphaned_by_kill_9_is_adopted_and_stopped_by_the_next_user(
    pgdata: Path,
) -> None:
    killed = Child(pgdata)
    killed.process.kill()
    assert killed.wait() == -signal.SIGKILL
    # Nothing can clean up after SIGKILL: the server outlives its last user...
    assert postmasters(pgdata) == [killed.postmaster_pid]

    # ...until the next command attaches to it and, leaving last, stops it.
    adopter = Child(pgdata)
    assert adopter.postmaster_pid == killed.postmaster_pid
    assert set(users_register(pgdata)) == {str(adopter.pid)}
    assert adopter.finish() == 0
    assert wait_for_no_postmaster(pgdata) == []


def test_sigterm_to_uvicorn_serving_stops_the_server(pgdata: Path, tmp_path: Path) -> None:
    # uvicorn swaps in its own SIGTERM handler while serving, then puts ours
    # back and re-raises the signal; without our handler that re-raise would
    # kill the process before it lets go of the server.
    socket_path = tmp_path / "api.sock"
    child = Child(pgdata, "uvicorn", str(socket_path))
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while not socket_path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert socket_path.exists()

    child.process.send_signal(signal.SIGTERM)
    assert child.wait() == 128 + signal.SIGTERM
    assert wait_for_no_postmaster(pgdata) == []


async def test_nested_open_in_one_process_and_sqlalchemy_url(tmp_path: Path) -> None:
    # A "+" in the socket directory: a query string would read it as a space
    # unless the DSN quotes it.
    pgdata = tmp_path / "c++" / "pgdata"
    try:
        with open_database(data_dir=pgdata) as outer:
            assert outer.embedded
            assert outer.data_dir == pgdata
            assert outer.dsn == f"postgresql://postgres@/postgres?host={tmp_path}/c%2B%2B/pgdata"
            [postmaster] = postmasters(pgdata)
            with open_database(data_dir=pgdata) as inner:
                assert inner.dsn == outer.dsn
                assert postmasters(pgdata) == [postmaster]
            # The outer handle still holds the server.
            assert postmasters(pgdata) == [postmaster]
            assert set(users_register(pgdata)) == {str(os.getpid())}
            engine = create_async_engine(sqlalchemy_url(outer.dsn))
            try:
                async with engine.connect() as conn:
                    assert await conn.scalar(text("select 41 + 1")) == 42
            finally:
                await engine.dispose()
            assert await postmaster_start_time(outer.dsn) > 0
        assert wait_for_no_postmaster(pgdata) == []
    finally:
        for pid in postmasters(pgdata):
            psutil.Process(pid).kill()


async def test_data_dir_with_a_space_starts(tmp_path: Path) -> None:
    # The package hands the socket directory to pg_ctl's shell unquoted; the
    # default data directory on macOS ("Application Support") has a space.
    pgdata = tmp_path / "Application Support" / "pgdata"
    try:
        with open_database(data_dir=pgdata) as db:
            assert " " not in db.dsn
            assert await postmaster_start_time(db.dsn) > 0
            assert len(postmasters(pgdata)) == 1
        assert wait_for_no_postmaster(pgdata) == []
    finally:
        for pid in postmasters(pgdata):
            psutil.Process(pid).kill()


def test_stale_postmaster_pid_naming_a_recycled_pid_is_not_taken_for_a_server(
    pgdata: Path,
) -> None:
    with open_database(data_dir=pgdata):
        pidfile = (pgdata / "postmaster.pid").read_text()
    assert wait_for_no_postmaster(pgdata) == []
    # As after a crash and a container restart: the old postmaster's pid now
    # belongs to some other process.
    impostor = subprocess.Popen([shutil.which("sleep") or "sleep", "60"])
    try:
        lines = pidfile.splitlines()
        lines[0] = str(impostor.pid)
        (pgdata / "postmaster.pid").write_text("\n".join(lines) + "\n")

        with open_database(data_dir=pgdata) as db:
            [postmaster] = postmasters(pgdata)
            assert postmaster != impostor.pid
            assert asyncio.run(postmaster_start_time(db.dsn)) > 0
        assert wait_for_no_postmaster(pgdata) == []
        assert impostor.poll() is None  # left alone
    finally:
        impostor.kill()
        impostor.wait()


def test_database_url_is_used_as_given_without_an_embedded_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = "postgresql://quota:s3cr%40t@db.example.com:6543/quota?sslmode=require"
    pgdata = tmp_path / "pgdata"
    monkeypatch.setenv(DATABASE_URL_ENV, url)
    monkeypatch.setenv(DATA_DIR_ENV, str(pgdata))

    settings = Settings()
    with open_database(settings.database_url, settings.data_dir) as db:
        assert db.dsn == url
        assert not db.embedded
        assert db.data_dir is None
    assert not pgdata.exists()
    assert postmasters(pgdata) == []

    other = "postgresql://other@localhost/other"
    with open_database(database_url=other) as db:
        assert db.dsn == other
        assert not db.embedded


def test_sqlalchemy_url_and_default_data_dir() -> None:
    assert (
        sqlalchemy_url("postgresql://postgres@/postgres?host=/tmp/a%20b")
        == "postgresql+asyncpg://postgres@/postgres?host=/tmp/a%20b"
    )
    assert sqlalchemy_url("postgres://u:p@h:5433/d") == "postgresql+asyncpg://u:p@h:5433/d"
    assert sqlalchemy_url("postgresql+asyncpg://u@h/d") == "postgresql+asyncpg://u@h/d"
    with pytest.raises(ValueError, match="not a PostgreSQL URL"):
        sqlalchemy_url("mysql://u@h/d")
    assert default_data_dir().parts[-2:] == ("llmquota", "pgdata")
