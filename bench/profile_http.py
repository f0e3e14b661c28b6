"""Where a server worker's CPU per HTTP admission goes: `python bench/profile_http.py`.

Standalone, not part of bench/run.py: it starts Debian's PostgreSQL 15 (or
the embedded one), seeds comparison 2's 10,000 tenants, starts `llmquota
serve` the way comparison 2 does and drives POST /v1/admit with wrk (64
connections, uniform tenants) for `--seconds`, then POST .../settle on as
many reservations made beforehand; and before both, bench/bare_asgi.py (the
cheapest answer on the same uvicorn) under the same load. It prints the
requests/s and the server's CPU per request of each (all its worker
processes, user + system, from psutil): on a shared machine that figure
moves far less than throughput, so it is the one to compare before and after
a change. The summary line: `http cpu per request: admit X us, settle Y us,
bare asgi Z us`.

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
import tempfile
import time
from pathlib import Path

import asyncpg
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path[0] = str(ROOT)

from bench import common, http_admission, servers  # noqa: E402
from llmquota import Limiter, Settings  # noqa: E402

TENANTS = 10_000
# The tenants of the allotted admit run.
ALLOTTED_TENANTS = 10
CONNECTIONS = 64
# Lines of each py-spy table printed.
TOP_FRAMES = 30


def workers_of(supervisor: subprocess.Popen[bytes]) -> list[psutil.Process]:
    """The uvicorn worker processes (spawned children, not the resource tracker);
    with one worker, uvicorn serves in the process it was started as."""
    children = psutil.Process(supervisor.pid).children(recursive=True)
    spawned = [child for child in children if "spawn_main" in " ".join(child.cmdline())]
    return spawned or [psutil.Process(supervisor.pid)]


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


SETTLE_SCRIPT = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer {key}"
local ids = {{}}
for line in io.lines("{ids}") do ids[#ids + 1] = line end
local body = '{{"input_tokens": 13, "output_tokens": 400}}'
local i = 0
request = function()
  i = i + 1
  return wrk.format(nil, "/v1/reservations/" .. ids[math.min(i, #ids)] .. "/settle", nil, body)
end
"""
# Reservations made for the settle run, per second of it: more than a worker pair settles.
SETTLES_PER_SECOND = 9_000


def measure(args: argparse.Namespace, dsn: str) -> None:
    bare_us = measure_bare(args)
    process, port = http_admission.start_llmquota(dsn, workers=args.workers)
    try:
        http_admission.run_wrk(
            port, system="warm-up", workload="warm-up", tenants=2, connections=64, seconds=3
        )
        workers = workers_of(process)
        spy = start_py_spy(args, workers[0].pid)
        admit, admit_us = cpu_per_request(workers, port, args.seconds, "admit")
        if spy is not None:
            stop_py_spy(spy)
        ids = asyncio.run(reservations(dsn, round(args.seconds * SETTLES_PER_SECOND)))
        lua = SETTLE_SCRIPT.format(key=http_admission.ADMIN_KEY, ids=ids)
        settle, settle_us = cpu_per_request(workers, port, args.seconds, "settle", lua)
        ids.unlink()
        allotted, allotted_us = cpu_per_request(
            workers, port, args.seconds, "admit, allotted", tenants=ALLOTTED_TENANTS
        )
    finally:
        http_admission.stop(process)
    runs = (
        ("admit", admit, admit_us),
        ("settle", settle, settle_us),
        (f"admit, {ALLOTTED_TENANTS} allotted tenants", allotted, allotted_us),
    )
    for name, result, us in runs:
        print(
            f"{name}: {result.per_second:.0f}/s, p50 {result.p50_ms:.1f} ms, "
            f"p99 {result.p99_ms:.1f} ms, non-2xx {result.non_2xx}; "
            f"server CPU per request {us:.0f} us"
        )
    print(
        f"http cpu per request: admit {admit_us:.0f} us, settle {settle_us:.0f} us, "
        f"bare asgi {bare_us:.0f} us ({args.workers} workers, {common.machine_load()})"
    )
    print(f"http cpu per allotted admit: {allotted_us:.0f} us ({ALLOTTED_TENANTS} tenants)")
    if args.py_spy is not None:
        summarize(args.py_spy)


def measure_bare(args: argparse.Namespace) -> float:
    """CPU per request of bench/bare_asgi.py under the admit run's load."""
    process, port = http_admission.start_bare_asgi(workers=args.workers)
    try:
        http_admission.run_wrk(
            port, system="warm-up", workload="warm-up", tenants=2, connections=64, seconds=2
        )
        _result, us = cpu_per_request(workers_of(process), port, args.seconds, "bare asgi")
    finally:
        http_admission.stop(process)
    return us


def cpu_per_request(
    workers: list[psutil.Process],
    port: int,
    seconds: float,
    system: str,
    lua: str | None = None,
    *,
    tenants: int = TENANTS,
) -> tuple[http_admission.HttpResult, float]:
    """One wrk run against the server; its result and the workers' CPU per request in us."""
    cpu_before = cpu_seconds(workers)
    result = http_admission.run_wrk(
        port,
        system=system,
        workload="10k",
        tenants=tenants,
        connections=CONNECTIONS,
        seconds=seconds,
        lua=lua,
    )
    cpu = cpu_seconds(workers) - cpu_before
    return result, 1e6 * cpu / (result.per_second * round(seconds))


def start_py_spy(args: argparse.Namespace, pid: int) -> subprocess.Popen[bytes] | None:
    """py-spy sampling one worker for the admit run, when --py-spy asks."""
    if args.py_spy is None:
        return None
    args.py_spy.parent.mkdir(parents=True, exist_ok=True)
    spy = subprocess.Popen(
        [
            str(Path(sys.executable).with_name("py-spy")),
            *("record", "--format", "raw", "-r", "250", "-o", str(args.py_spy)),
            *("-d", str(round(args.seconds)), "-p", str(pid)),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    time.sleep(0.5)
    return spy


def stop_py_spy(spy: subprocess.Popen[bytes]) -> None:
    """Wait for py-spy's file; a py-spy that failed says why, here, not in a
    missing file later."""
    _, errors = spy.communicate(timeout=60)
    if spy.returncode != 0:
        raise SystemExit(f"py-spy failed ({spy.returncode}): {errors.decode().strip()}")


async def reservations(dsn: str, count: int) -> Path:
    """`count` open reservations over the 10,000 tenants, their ids in a file, one a line."""
    limiter = await Limiter.connect(dsn, Settings(database_url=dsn))
    ids: list[str] = []

    async def caller(offset: int) -> None:
        for index in range(offset, count, CONNECTIONS):
            admitted = await limiter.admit(
                tenant=f"t{index % TENANTS}", model="gpt-4o", input_tokens=13, max_tokens=2_000
            )
            ids.append(str(admitted.reservation_id))

    try:
        await asyncio.gather(*(caller(offset) for offset in range(CONNECTIONS)))
    finally:
        await limiter.close()
    with tempfile.NamedTemporaryFile("w", suffix=".ids", delete=False) as out:
        out.write("\n".join(ids) + "\n")
    return Path(out.name)


async def prepare(server_dsn: str) -> str:
    """10,000 tenants; the first ALLOTTED_TENANTS say "admission": "allotted" (the
    admit run touches them a thousandth of the time; the allotted run only them)."""
    dsn = await common.fresh_database(server_dsn, "bench_http_profile")
    await common.seed_tenants(dsn, TENANTS)
    connection = await asyncpg.connect(dsn)
    try:
        await connection.execute(
            "UPDATE limit_layers SET admission = 'allotted',"
            " policy_version = nextval('policy_version_seq')"
            " WHERE scope = 'tenant' AND tenant = ANY ($1::text[])",
            [f"t{i}" for i in range(ALLOTTED_TENANTS)],
        )
    finally:
        await connection.close()
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
