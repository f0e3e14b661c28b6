"""Comparison 7: past one server, 1, 2 and 3 `llmquota serve` replicas on one PostgreSQL.

Each replica is a separate single-worker `llmquota serve` on its own port,
holding no state of its own; one wrk per replica shares the same total of
connections, all at once, over 10,000 tenants. Throughput is the sum of the
wrk runs, p99 the worst of them. On this lab's two shared cores the replicas
compete with PostgreSQL for the same CPU, so this measures what the database
and the machine allow, not what more machines would.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from bench import http_admission

REPLICAS = (1, 2, 3)
WARM_UP_S = 2.0


@dataclass(frozen=True)
class ReplicasResult:
    replicas: int
    connections: int
    per_second: float
    p99_ms: float
    non_2xx: int


@contextlib.contextmanager
def replicas(dsn: str, count: int) -> Iterator[list[int]]:
    """`count` single-worker servers on `dsn`; their ports. Always stopped."""
    started: list[tuple[subprocess.Popen[bytes], int]] = []
    try:
        for _ in range(count):
            started.append(http_admission.start_llmquota(dsn, workers=1))
        yield [port for _, port in started]
    finally:
        for process, _ in started:
            http_admission.stop(process)


def _wrk_all(
    ports: Sequence[int], *, tenants: int, connections: int, seconds: float
) -> list[http_admission.HttpResult]:
    """One wrk per port, all at once, sharing `connections`."""
    each = max(1, connections // len(ports))
    with ThreadPoolExecutor(len(ports)) as pool:
        runs = [
            pool.submit(
                http_admission.run_wrk,
                port,
                system=f"replica {index}",
                workload="10k",
                tenants=tenants,
                connections=each,
                seconds=seconds,
            )
            for index, port in enumerate(ports)
        ]
        return [run.result() for run in runs]


def measure(
    dsn: str, count: int, *, tenants: int, connections: int, seconds: float
) -> ReplicasResult:
    """Throughput of `count` replicas together."""
    with replicas(dsn, count) as ports:
        _wrk_all(ports, tenants=2, connections=connections, seconds=WARM_UP_S)
        results = _wrk_all(ports, tenants=tenants, connections=connections, seconds=seconds)
    return ReplicasResult(
        replicas=count,
        connections=connections,
        per_second=sum(r.per_second for r in results),
        p99_ms=max(r.p99_ms for r in results),
        non_2xx=sum(r.non_2xx for r in results),
    )
