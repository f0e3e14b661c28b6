"""Where a server worker's CPU per HTTP admission goes: `python bench/profile_http.py`.

Standalone, not part of bench/run.py: it starts Debian's PostgreSQL 15 (or
the embedded one), seeds comparison 2's 10,000 tenants, starts `llmquota
serve` the way comparison 2 does and drives POST /v1/admit with wrk (64
connections, uniform tenants) for `--seconds`. It prints the requests/s and
the server's CPU per request (all its worker processes, user + system, from
psutil): on a shared machine that figure moves far less than throughput, so
it is the one to compare before and after a change.

With `--py-spy FILE` one worker is sampled by py-spy during the measured run
(`--format raw`, collapsed stacks) and the frames holding the most samples
are printed, inclusive and by innermost frame.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path[0] = str(ROOT)

from bench import common, http_admission, servers  # noqa: E402

TENANTS = 10_000
CONNECTIONS = 64
# Lines of each py-spy table printed.
TOP_FRAMES = 30


def workers_of(supervisor: subprocess.Popen[bytes]) -> list[psutil.Process]:
    """The uvicorn worker processes (spawned children, not the resource tracker)."""
    children = psutil.Process(supervisor.pid).children(recursive=True)
    return [child for child in children if "spawn_main" in " ".join(child.cmdline())]


def cpu_seconds(processes: list[psutil.Process]) -> float:
    total = 0.0
    for process in processes:
        times = process.cpu_times()
        total += times.user + times.system
    return total


# Where a sample is charged: the innermost frame on its stack matching one of
# these (first match in this order for that frame); stacks matching none are
# the event loop's own work (uvloop or asyncio, callbacks, the protocol's C parser).
COMPONENTS = (
    ("token counting: the thread CPU clock (CpuBudget)", ("CpuBudget",)),
    ("token counting (tiktoken)", ("tiktoken", "domain/tokens", "admission/counting")),
    ("request id (secrets.token_hex)", ("new_request_id",)),
    ("authentication", ("api/auth", "api/keycache", "domain/keys")),
    ("metrics (prometheus_client)", ("prometheus_client",)),
    ("admission: limiter, store, asyncpg", ("llmquota/admission", "llmquota/store", "asyncpg")),
    ("rate-limit headers", ("api/headers",)),
    ("pydantic", ("pydantic",)),
    ("json", ("json/",)),
    ("FastAPI: routing, dependencies, responses", ("fastapi/",)),
    ("Starlette", ("starlette/",)),
    ("llmquota middlewares", ("api/requestids", "api/fairness", "api/bodylimit")),
    ("llmquota routes and answers", ("api/routes", "api/refusals", "api/fast", "api/errors")),
    ("uvicorn protocol", ("uvicorn/protocols",)),
)
# A thread that is not the event loop's (uvicorn's supervisor pipe, waiting).
OTHER_THREAD = "Thread._bootstrap"


def component(frames: list[str]) -> str:
    for frame in reversed(frames):
        for name, needles in COMPONENTS:
            if any(needle in frame for needle in needles):
                return name
    return "event loop (uvloop/asyncio, callbacks)"


def summarize(raw: Path) -> None:
    """Print the event loop thread's samples by component, and the hottest frames."""
    by_component: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or OTHER_THREAD in stack:
            continue
        count = int(count_text)
        frames = stack.split(";")
        total += count
        own[frames[-1]] += count
        by_component[component(frames)] += count
    print(f"-- by component (of {total} samples of the event loop thread)")
    for name, count in by_component.most_common():
        print(f"{100 * count / total:5.1f}%  {name}")
    print("-- innermost frames")
    for frame, count in own.most_common(TOP_FRAMES):
        print(f"{100 * count / total:5.1f}%  {frame}")


def measure(args: argparse.Namespace, dsn: str) -> None:
    process, port = http_admission.start_llmquota(dsn, workers=args.workers)
    try:
        http_admission.run_wrk(
            port, system="warm-up", workload="warm-up", tenants=2, connections=64, seconds=3
        )
        workers = workers_of(process)
        spy = None
        if args.py_spy is not None:
            spy = subprocess.Popen(
                [
                    str(Path(sys.executable).with_name("py-spy")),
                    *("record", "--format", "raw", "-r", "250", "-o", str(args.py_spy)),
                    *("-d", str(round(args.seconds)), "-p", str(workers[0].pid)),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            time.sleep(0.5)
        cpu_before = cpu_seconds(workers)
        result = http_admission.run_wrk(
            port,
            system="llmquota serve",
            workload="10k",
            tenants=TENANTS,
            connections=CONNECTIONS,
            seconds=args.seconds,
        )
        cpu = cpu_seconds(workers) - cpu_before
        if spy is not None:
            spy.wait(60)
    finally:
        http_admission.stop(process)
    requests = result.per_second * round(args.seconds)
    print(
        f"{result.per_second:.0f}/s, p50 {result.p50_ms:.1f} ms, p99 {result.p99_ms:.1f} ms, "
        f"non-2xx {result.non_2xx}; server CPU per request {1e6 * cpu / requests:.0f} us "
        f"({len(workers)} workers, {common.machine_load()})"
    )
    if args.py_spy is not None:
        summarize(args.py_spy)


async def prepare(server_dsn: str) -> str:
    dsn = await common.fresh_database(server_dsn, "bench_http_profile")
    await common.seed_tenants(dsn, TENANTS)
    return dsn


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--workers", type=int, default=http_admission.WORKERS)
    parser.add_argument("--py-spy", type=Path, default=None, help="collapsed stacks to this file")
    parser.add_argument(
        "--postgres",
        choices=("pg15", "embedded"),
        default="pg15" if servers.pg15_available() else "embedded",
    )
    args = parser.parse_args()
    with servers.postgres(args.postgres) as pg:
        measure(args, asyncio.run(prepare(pg.dsn)))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--summarize":
        summarize(Path(sys.argv[2]))
        raise SystemExit(0)
    raise SystemExit(main())
