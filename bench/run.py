"""The benchmark lab: `python bench/run.py` (`--quick`: smaller runs, about five minutes).

Starts what it needs on loopback (PostgreSQL, redis-server), runs every
comparison side by side in this one run, prints one summary line per
comparison, and writes BENCHMARKS.md with PNG charts. A full run writes the
committed report (BENCHMARKS.md, docs/bench/*.png); --quick writes to
bench/results/ (git-ignored) so it never overwrites measured numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import functools
import platform
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Run as a script, Python puts bench/ first on the path; the repository root
# instead lets `bench.*` import as a package and never shadows the stdlib.
sys.path[0] = str(ROOT)

from bench import (  # noqa: E402
    allotment_slack,
    burst,
    charts,
    common,
    crash,
    estimates,
    grid,
    growth,
    http_admission,
    library,
    library_open_loop,
    oversubscription,
    pgbench,
    redis_lua,
    response_cache,
    scaleout,
    servers,
    shards,
)

COMMAND_FULL = "python bench/run.py"
COMMAND_QUICK = "python bench/run.py --quick"
TENANTS = 10_000
CALLERS = (1, 16, 64, 256)
HTTP_CONNECTIONS = 64


@dataclass(frozen=True)
class Plan:
    """How long each measurement runs; --quick shrinks everything."""

    quick: bool
    library_s: float
    http_s: float
    pgbench_s: float
    burst_window_s: float
    burst_speedup: float
    grid_rates: tuple[int, ...]
    grid_lengths: tuple[int, ...]
    grid_s: float
    growth: growth.Sizes
    growth_s: float
    crash_load_s: float


FULL = Plan(
    quick=False,
    library_s=5.0,
    http_s=10.0,
    pgbench_s=10.0,
    burst_window_s=10.0,
    burst_speedup=10.0,
    grid_rates=(25, 50, 100, 200, 400),
    grid_lengths=(10, 100, 300, 1_000, 3_000),
    grid_s=2.0,
    growth=growth.FULL,
    growth_s=3.0,
    crash_load_s=3.0,
)
QUICK = Plan(
    quick=True,
    library_s=0.8,
    http_s=2.0,
    pgbench_s=2.0,
    burst_window_s=4.0,
    burst_speedup=25.0,
    grid_rates=(25, 100, 400),
    grid_lengths=(10, 300, 3_000),
    grid_s=0.8,
    growth=growth.QUICK,
    growth_s=1.0,
    crash_load_s=1.0,
)


class Report:
    """Collects markdown sections and prints summary lines as they come."""

    def __init__(self, charts_dir: Path, markdown_path: Path) -> None:
        self.charts_dir = charts_dir
        self.markdown_path = markdown_path
        self.sections: list[str] = []
        self.summary: list[str] = []

    def line(self, text: str, *, summary: bool = False) -> None:
        print(text, flush=True)
        if summary:
            self.summary.append(text)

    def chart(self, name: str) -> tuple[Path, str]:
        """Where to write a chart, and how the markdown links it."""
        path = self.charts_dir / name
        return path, path.relative_to(self.markdown_path.parent).as_posix()


def ms(value: float) -> str:
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


# -- 1 -----------------------------------------------------------------------------------


async def compare_library(
    pg: servers.Postgres, redis: servers.Redis, plan: Plan, report: Report
) -> tuple[float, redis_lua.Client]:
    """llmquota's admissions/s at 10,000 tenants and 64 callers, and the fastest Redis client."""
    report.line("== 1. library admissions: llmquota vs Redis + Lua, one process")
    dsn = await common.fresh_database(pg.dsn, "bench_library")
    tenants = await common.seed_tenants(dsn, TENANTS)
    points: list[library.Point] = []
    load = common.machine_load()
    for workload in ("hot", "10k"):
        for callers in CALLERS:
            runs = [
                library.llmquota_point(
                    dsn,
                    library.LLMQUOTA,
                    workload=workload,
                    tenants=tenants,
                    callers=callers,
                    seconds=plan.library_s,
                )
            ]
            runs += [
                library.redis_point(
                    redis.host,
                    redis.port,
                    client,
                    workload=workload,
                    tenants=tenants,
                    callers=callers,
                    seconds=plan.library_s,
                )
                for client in redis_lua.CLIENTS
            ]
            for run in runs:
                point = await run
                points.append(point)
                report.line(
                    f"  {point.system:36} {workload:3} {callers:3} callers: "
                    f"{point.result.per_second:8.0f}/s  p50 {ms(point.result.p50_ms)} ms  "
                    f"p99 {ms(point.result.p99_ms)} ms  "
                    f"cpu {point.result.cpu_us_per_call:.0f} us/call"
                )
    for workload in ("hot", "10k"):
        for variant in library.VARIANTS_AT_64:
            point = await library.llmquota_point(
                dsn,
                variant,
                workload=workload,
                tenants=tenants,
                callers=64,
                seconds=plan.library_s,
            )
            points.append(point)
            report.line(
                f"  {point.system} {workload} 64 callers: {point.result.per_second:.0f}/s  "
                f"p99 {ms(point.result.p99_ms)} ms"
            )

    crash_rows = await measure_crashes(plan, report)
    open_loop = await library_open_loop.measure(
        dsn,
        redis.host,
        redis.port,
        redis_lua.CLIENTS_BY_NAME["valkey-glide"],
        tenants,
        seconds=plan.library_s,
    )
    for result in open_loop:
        report.line(
            f"  {result.system} open loop {result.rate}/s: p50 {ms(result.p50_ms)} ms  "
            f"p99 {ms(result.p99_ms)} ms ({result.answered} of {result.sent} measured)"
        )
    open_line = library_open_loop.summary(open_loop)

    ended_load = common.machine_load()

    def find(system: str, workload: str, callers: int) -> library.Point | None:
        for p in points:
            if (p.system, p.workload, p.callers) == (system, workload, callers):
                return p
        return None

    rows = [
        "| system | tenants | callers | admissions/s | p50 ms | p99 ms "
        "| process CPU us per admission |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for p in points:
        rows.append(
            f"| {p.system} | {'1 hot' if p.workload == 'hot' else '10,000'} | {p.callers} "
            f"| {p.result.per_second:,.0f} | {ms(p.result.p50_ms)} | {ms(p.result.p99_ms)} "
            f"| {p.result.cpu_us_per_call:.0f} |"
        )
    path, link = report.chart("library.png")
    charts.library_chart(points, path)
    ours = find("llmquota", "10k", 64)
    hot = find("llmquota", "hot", 64)
    assert ours is not None and hot is not None
    theirs = [p for p in points if p.system.startswith("redis-lua") and p.workload == "10k"]
    theirs = [p for p in theirs if p.callers == 64]
    best = max(theirs, key=lambda p: p.result.per_second)
    # The client a careful user would pick for CPU: the one spending least per call.
    frugal = min(theirs, key=lambda p: p.result.cpu_us_per_call)
    value = ratio(ours.result.per_second, best.result.per_second)
    client_name = best.system.removeprefix("redis-lua, ")
    last = f"admission ratio llmquota/redis-lua(best client): {value:.2f} ({client_name})"
    allotted = allotted_line(points, theirs, best)
    cpu = (
        f"python cpu per admission: llmquota {ours.result.cpu_us_per_call:.0f} us, "
        f"redis-lua best client {frugal.result.cpu_us_per_call:.0f} us "
        f"({frugal.system.removeprefix('redis-lua, ')})"
    )
    report.sections.append(
        "\n".join(
            [
                "## 1. Library admissions: llmquota vs the seeds' Redis + Lua token bucket",
                "",
                "Closed-loop callers in one Python process, each awaiting one admission after",
                "another: `await limiter.admit(...)` (validation, group admission, a Reservation",
                "journalled in PostgreSQL) against `await bucket.reserve(...)` (one EVALSHA of",
                "`bench/token_bucket.lua`, the seeds' script over the tenant and global keys).",
                "Every request passes a tenant layer and the global layer; buckets are large",
                "enough that nothing is refused, so this measures the cost of deciding.",
                f"Each point runs {plan.library_s:g} s after a warm-up; {load} at the start,",
                f"{ended_load} at the end.",
                "",
                *rows,
                "",
                f"![admissions per second and p99 against callers]({link})",
                "",
                f"One hot tenant, 64 callers: {hot.result.per_second:,.0f} admissions/s, "
                f"p99 {ms(hot.result.p99_ms)} ms.",
                "",
                *crash_section(crash_rows),
                f"`{last}`",
                "",
                f'`{allotted}` (every tenant\'s policy `"admission": "allotted"`: the',
                "hot tenant's requests come from slices this worker holds; with 10,000 tenants",
                "most calls are a tenant's first in a while and need a slice of their own,",
                "one statement each; the Redis figure is the best client's at that workload).",
                "",
                f"`{cpu}` (process CPU time over the window / admissions, 10,000 tenants,",
                "64 callers; the Redis client spending the least per call, among redis-py",
                "with hiredis at each pool size and valkey-glide, whose own Rust threads",
                "count in its process too).",
                "",
                f"`{open_line}` (`bench/library_open_loop.py`: arrivals at a fixed rate from",
                "a process of their own, each for one of 100 tenants at random, latency from",
                "the moment each was due; llmquota exact, then every tenant allotted, then",
                "the Redis + Lua bucket on valkey-glide).",
            ]
        )
    )
    report.line(last, summary=True)
    report.line(allotted, summary=True)
    report.line(cpu, summary=True)
    report.line(open_line, summary=True)
    return ours.result.per_second, redis_lua.CLIENTS_BY_NAME[client_name]


def allotted_line(
    points: list[library.Point], theirs: list[library.Point], best: library.Point
) -> str:
    """The allotted variant against the best Redis client: hot tenant first, then 10,000."""
    figures = {}
    for workload in ("hot", "10k"):
        ours = [p for p in points if p.system == library.ALLOTTED.name and p.workload == workload]
        redis = [
            p
            for p in points
            if p.system.startswith("redis-lua") and p.workload == workload and p.callers == 64
        ]
        top = max(redis or theirs or [best], key=lambda p: p.result.per_second)
        figures[workload] = ratio(ours[0].result.per_second, top.result.per_second)
    return (
        f"admission ratio allotted/redis-lua(best client): {figures['hot']:.2f} "
        f"(one hot tenant; 10,000 tenants: {figures['10k']:.2f})"
    )


async def measure_crashes(plan: Plan, report: Report) -> list[str]:
    """Table rows: admissions lost by a crash, synchronous_commit off and on."""
    if not servers.pg15_available():
        return []
    rows = [
        "| synchronous_commit for admission | admissions acknowledged before the crash "
        "| lost after recovery |",
        "| --- | ---: | ---: |",
    ]
    for synchronous_commit in (False, True):
        outcome = await crash.measure(synchronous_commit, load_s=plan.crash_load_s)
        setting = "on" if synchronous_commit else "off"
        rows.append(f"| {setting} | {outcome.acknowledged:,} | {outcome.lost:,} |")
        report.line(
            f"  crash with synchronous_commit {setting}: {outcome.lost} of "
            f"{outcome.acknowledged} acknowledged admissions lost"
        )
    return rows


def crash_section(rows: list[str]) -> list[str]:
    if not rows:
        return ["(The crash measurement needs Debian's PostgreSQL 15; skipped.)", ""]
    return [
        "### synchronous_commit off for admission: what a crash loses",
        "",
        "The rows above with `synchronous_commit off` show the gain. The cost, measured:",
        "64 callers admit against a throwaway PostgreSQL 15 cluster, which is then killed",
        "with `pg_ctl stop -m immediate` (no process writes anything further) and",
        "restarted; admissions acknowledged before the kill and missing after recovery",
        "are lost. See the trade-off discussion at the top of this file.",
        "",
        *rows,
        "",
    ]


# -- 2 -----------------------------------------------------------------------------------


async def prepare_http_database(pg: servers.Postgres) -> str:
    dsn = await common.fresh_database(pg.dsn, "bench_http")
    await common.seed_tenants(dsn, TENANTS)
    return dsn


def compare_http(
    pg: servers.Postgres,
    redis: servers.Redis,
    client: redis_lua.Client,
    plan: Plan,
    report: Report,
) -> None:
    report.line("== 2. HTTP admission: llmquota serve vs FastAPI + Redis-Lua middleware")
    dsn = asyncio.run(prepare_http_database(pg))
    workloads = {"hot": 1, "10k": TENANTS}
    load = common.machine_load()
    results = measure_http_systems(
        pg, dsn, redis, client, plan, workers=http_admission.WORKERS, workloads=workloads
    )
    one_worker = measure_http_systems(
        pg, dsn, redis, client, plan, workers=1, workloads={"10k": TENANTS}
    )
    rows = [
        "| server | tenants | admissions/s | p50 ms | p99 ms | non-2xx |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in results + one_worker:
        report.line(
            f"  {r.system:20} {r.workload:3}: {r.per_second:8.0f}/s  p50 {ms(r.p50_ms)} ms  "
            f"p99 {ms(r.p99_ms)} ms  non-2xx {r.non_2xx}"
        )
        rows.append(
            f"| {r.system} | {HTTP_WORKLOAD_TEXT.get(r.workload, r.workload)} "
            f"| {r.per_second:,.0f} | {ms(r.p50_ms)} | {ms(r.p99_ms)} | {r.non_2xx} |"
        )
    path, link = report.chart("http.png")
    charts.http_chart(
        [r for r in results if r.workload in workloads and r.system != RAW_BASELINE], path
    )
    by = {(r.system, r.workload): r for r in results}
    open_loop = http_admission.open_loop_workload(HTTP_OPEN_LOOP_RATE)
    ours_open = by[("llmquota serve", open_loop)]
    theirs_open = by[("FastAPI + Redis-Lua", open_loop)]
    open_line = (
        f"http open-loop {HTTP_OPEN_LOOP_RATE}/s: p50 {ms(ours_open.p50_ms)} ms, "
        f"p99 {ms(ours_open.p99_ms)} ms (llmquota serve, {WORKERS_TEXT}, 10k tenants, "
        f"{ours_open.non_2xx} errors; FastAPI + Redis-Lua p50 {ms(theirs_open.p50_ms)} ms, "
        f"p99 {ms(theirs_open.p99_ms)} ms)"
    )
    ours = by[("llmquota serve", "10k")]
    theirs = by[("FastAPI + Redis-Lua", "10k")]
    line = (
        f"http ratio: {ratio(ours.per_second, theirs.per_second):.2f} "
        f"(llmquota/fastapi-redis-lua on {client.name}, 10k tenants, {WORKERS_TEXT}, "
        f"{HTTP_CONNECTIONS} connections); p99 {ms(ours.p99_ms)} ms vs {ms(theirs.p99_ms)} ms"
    )
    cpu_line = open_loop_cpu_line(by)
    one_line = one_worker_line({(r.system, r.workload): r for r in one_worker})
    report.sections.append(
        "\n".join(
            [
                "## 2. HTTP admission end to end",
                "",
                "`llmquota serve --workers 2` against `bench/baseline_app.py` (FastAPI, an HTTP",
                "middleware in seed 001's shape calling the same Lua script through",
                f"{client.name}, the fastest client of comparison 1) under",
                "`uvicorn --workers 2`, and against `bench/raw_baseline_app.py`, the same",
                "work as a raw ASGI app with no framework (the fastest form; 10,000 tenants",
                "and the open loop only). All count the same messages",
                "with tiktoken and authenticate a bearer key; the load generator is wrk",
                f"(1 thread, {HTTP_CONNECTIONS} connections, {plan.http_s:g} s per run, "
                "POST /v1/admit with a JSON body). "
                f"llmquota answers 201 with a journalled reservation. At the start {load};",
                f"at the end {common.machine_load()}.",
                "",
                *rows,
                "",
                f"![HTTP admissions per second and p99]({link})",
                "",
                f"`{line}`",
                "",
                "The open-loop rows: `bench/open_loop.py` in a process of its own sends",
                f"{HTTP_OPEN_LOOP_RATE:,} requests/s at fixed times whatever the answers (a new",
                "keep-alive connection when all are busy), uniform over 10,000 tenants, for",
                f"{plan.http_s:g} s after 1 s of warm-up, and measures each latency from the",
                "time the request was due, so a server that falls behind is not hidden by",
                "a generator that waits for it (wrk's coordinated omission). Their",
                "non-2xx column also counts connection errors and answers slower than 30 s.",
                "",
                f"`{open_line}`",
                "",
                "Over each open-loop run, the CPU the server's processes (the uvicorn",
                "workers) and its store's (PostgreSQL's backends and background",
                "processes, or redis-server) spent, per request sent",
                "(`bench/process_cpu.py`; their idle work included, under 2% at this",
                "rate). At a rate far below saturation the latency follows it: what each",
                "request costs the two cores the load generator, the server and the",
                "store share.",
                "",
                f"`{cpu_line}`",
                "",
                "The rows named `1 worker` run every server again on one uvicorn worker,",
                "`llmquota serve`'s default.",
                "",
                f"`{one_line}`",
            ]
        )
    )
    report.line(line, summary=True)
    report.line(open_line, summary=True)
    for summary in raw_baseline_lines(by, client.name):
        report.line(summary, summary=True)
    report.line(cpu_line, summary=True)
    report.line(one_line, summary=True)


def measure_http_systems(
    pg: servers.Postgres,
    dsn: str,
    redis: servers.Redis,
    client: redis_lua.Client,
    plan: Plan,
    *,
    workers: int,
    workloads: dict[str, int],
) -> list[http_admission.HttpResult]:
    """llmquota serve, FastAPI + Redis-Lua and the raw ASGI baseline, each on
    `workers` uvicorn workers: wrk at each of `workloads` (the raw baseline at
    10,000 tenants only), then the open loop, with the CPU per request of the
    server's processes and of its store's. Systems on other than the usual
    worker count are named with it ("llmquota serve, 1 worker")."""
    named = "" if workers == http_admission.WORKERS else f", {workers} worker{'s' * (workers > 1)}"
    raw_app = "bench.raw_baseline_app:app"
    postgres, redis_server = pg.postmaster_pid(), redis.pid
    systems: list[tuple[str, Callable[[], http_admission.Started], int, dict[str, int]]] = [
        (
            "llmquota serve",
            lambda: http_admission.start_llmquota(dsn, workers),
            postgres,
            workloads,
        ),
        (
            "FastAPI + Redis-Lua",
            lambda: http_admission.start_baseline(
                redis.host, redis.port, client.name, workers=workers
            ),
            redis_server,
            workloads,
        ),
        (
            RAW_BASELINE,
            lambda: http_admission.start_baseline(
                redis.host, redis.port, client.name, app=raw_app, workers=workers
            ),
            redis_server,
            {"10k": TENANTS},
        ),
    ]
    results: list[http_admission.HttpResult] = []
    for system, start, store_pid, loads in systems:
        results += http_admission.measure(
            start(),
            system=system + named,
            workloads=loads,
            connections=HTTP_CONNECTIONS,
            seconds=plan.http_s,
            open_loop=(TENANTS, HTTP_OPEN_LOOP_RATE),
            store_pid=store_pid,
        )
    return results


def open_loop_cpu_line(by: dict[tuple[str, str], http_admission.HttpResult]) -> str:
    """Where the open loop's CPU goes, per request: the server's processes and
    the store's. At a rate far below saturation, latency follows what each
    request costs the two cores (BENCHMARKS.md, issue 25's tenth part)."""
    open_loop = http_admission.open_loop_workload(HTTP_OPEN_LOOP_RATE)
    parts = []
    for system, store in OPEN_LOOP_STORES:
        result = by[(system, open_loop)]
        server, stored = result.server_cpu_us or 0.0, result.store_cpu_us or 0.0
        parts.append(
            f"{system} {server + stored:,.0f} us (server {server:,.0f}, {store} {stored:,.0f})"
        )
    return f"http open-loop {HTTP_OPEN_LOOP_RATE}/s cpu per request: " + "; ".join(parts)


def one_worker_line(by: dict[tuple[str, str], http_admission.HttpResult]) -> str:
    """Every server on one uvicorn worker (`llmquota serve`'s default), beside
    the usual two (BENCHMARKS.md, issue 25's tenth part)."""
    open_loop = http_admission.open_loop_workload(HTTP_OPEN_LOOP_RATE)
    parts = []
    for system, _ in OPEN_LOOP_STORES:
        name = f"{system}, 1 worker"
        saturated, opened = by[(name, "10k")], by[(name, open_loop)]
        cpu = (opened.server_cpu_us or 0.0) + (opened.store_cpu_us or 0.0)
        parts.append(
            f"{system} {saturated.per_second:,.0f}/s, open loop p50 {ms(opened.p50_ms)} ms "
            f"p99 {ms(opened.p99_ms)} ms, cpu {cpu:,.0f} us"
        )
    return (
        f"http one worker each (10k tenants, wrk {HTTP_CONNECTIONS} connections; open loop "
        f"{HTTP_OPEN_LOOP_RATE}/s): " + "; ".join(parts)
    )


RAW_BASELINE = "raw ASGI + Redis-Lua"
# The systems of comparison 2, each with the store it calls.
OPEN_LOOP_STORES = (
    ("llmquota serve", "postgres"),
    ("FastAPI + Redis-Lua", "redis"),
    (RAW_BASELINE, "redis"),
)


def raw_baseline_lines(
    by: dict[tuple[str, str], http_admission.HttpResult], client: str
) -> list[str]:
    """llmquota beside the fastest baseline: raw_baseline_app.py, no framework."""
    ours, raw = by[("llmquota serve", "10k")], by[(RAW_BASELINE, "10k")]
    open_loop = http_admission.open_loop_workload(HTTP_OPEN_LOOP_RATE)
    ours_open, raw_open = by[("llmquota serve", open_loop)], by[(RAW_BASELINE, open_loop)]
    return [
        f"http ratio llmquota/raw-asgi-redis-lua: {ratio(ours.per_second, raw.per_second):.2f} "
        f"(on {client}, 10k tenants, {WORKERS_TEXT}, {HTTP_CONNECTIONS} connections); "
        f"p99 {ms(ours.p99_ms)} ms vs {ms(raw.p99_ms)} ms",
        f"http open-loop {HTTP_OPEN_LOOP_RATE}/s beside raw ASGI + Redis-Lua: llmquota p50 "
        f"{ms(ours_open.p50_ms)} ms, p99 {ms(ours_open.p99_ms)} ms; raw ASGI p50 "
        f"{ms(raw_open.p50_ms)} ms, p99 {ms(raw_open.p99_ms)} ms",
    ]


WORKERS_TEXT = f"{http_admission.WORKERS} workers"
# Issue 13: latency p99 <= 5 ms at this open-loop rate, 2 workers.
HTTP_OPEN_LOOP_RATE = 1_000
HTTP_WORKLOAD_TEXT = {
    "hot": "1 hot",
    "10k": "10,000",
    http_admission.open_loop_workload(HTTP_OPEN_LOOP_RATE): (
        f"10,000, open loop {HTTP_OPEN_LOOP_RATE:,}/s"
    ),
}


# -- 3 -----------------------------------------------------------------------------------


def compare_sql_ceiling(
    pg: servers.Postgres,
    library_dsn_name: str,
    plan: Plan,
    report: Report,
    service: float | None,
) -> None:
    report.line("== 3. SQL ceiling: pgbench running lq_admit")
    asyncio.run(common.reset_state(common.with_database(pg.dsn, library_dsn_name)))
    runs = [
        ("hot", 1, 1, 64, False),
        ("10k", TENANTS, 1, 64, False),
        ("hot", 1, pgbench.BATCH, 4, False),
        ("10k", TENANTS, pgbench.BATCH, 4, False),
        ("10k", TENANTS, pgbench.BATCH, 4, True),
    ]
    results = []
    for workload, tenants, batch, clients, plain_update in runs:
        result = pgbench.run(
            pg,
            library_dsn_name,
            workload=workload,
            tenants=tenants,
            batch=batch,
            clients=clients,
            seconds=plan.pgbench_s,
            plain_update=plain_update,
        )
        results.append(result)
        report.line(
            f"  pgbench {result.workload:20} {batch:2} per statement, {clients} clients: "
            f"{result.decisions_per_second:8.0f} decisions/s ({result.latency_ms:.2f} ms/stmt)"
        )
    rows = [
        "| statement | tenants | requests per statement | clients | decisions/s "
        "| ms per statement |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        statement = "plain batched UPDATE" if r.workload.endswith("plain update") else "lq_admit"
        rows.append(
            f"| {statement} | {'1 hot' if r.workload == 'hot' else '10,000'} "
            f"| {r.requests_per_statement} | {r.clients} | {r.decisions_per_second:,.0f} "
            f"| {r.latency_ms:.2f} |"
        )
    single_hot, single_10k, batch_hot, batch_10k, plain_10k = (
        r.decisions_per_second for r in results
    )
    sql_line = f"sql ratio lq_admit/plain-update: {ratio(batch_10k, plain_10k):.2f}"
    dsn = common.with_database(pg.dsn, library_dsn_name)
    statements = 100 if plan.quick else 300

    def cpu_ms(sql: str) -> float:
        return pgbench.statement_cpu_ms(dsn, sql, statements=statements, rounds=3)

    admit_cpu, plain_cpu, single_cpu, single_plain_cpu = (
        cpu_ms(pgbench.statement(TENANTS, batch, plain_update=plain))
        for batch in (pgbench.BATCH, 1)
        for plain in (False, True)
    )
    cpu_line = (
        f"sql cpu per {pgbench.BATCH}-request statement: lq_admit {admit_cpu:.2f} ms, "
        f"plain update {plain_cpu:.2f} ms (ratio {ratio(plain_cpu, admit_cpu):.2f})"
    )
    report.line(cpu_line, summary=True)
    # At the load most deployments see, a batch is one request or two: what a
    # statement costs per execution (locks, plans, constraints) is then the cost.
    single_line = (
        f"sql cpu per 1-request statement: lq_admit {single_cpu:.2f} ms, "
        f"plain update {single_plain_cpu:.2f} ms "
        f"(ratio {ratio(single_plain_cpu, single_cpu):.2f})"
    )
    report.line(single_line, summary=True)
    settled_ok, settled_error = (
        cpu_ms(pgbench.settle_script(TENANTS, pgbench.BATCH, outcome=outcome))
        for outcome in ("ok", "error")
    )
    settle_line = (
        f"sql cpu per {pgbench.BATCH}-request settle: lq_finish {settled_ok - admit_cpu:.2f} ms "
        f"(learned-estimate samples {settled_ok - settled_error:.2f} ms of it)"
    )
    report.line(settle_line, summary=True)
    # `service`: comparison 1's library figure, None when this run left it out.
    share = None if service is None else 100 * ratio(service, batch_10k)
    reached = (
        "the library was not measured (comparison 1 not run)"
        if share is None
        else f"library reaches {share:.0f}% of the batched 10k ceiling"
    )
    line = (
        f"sql ceiling (pgbench lq_admit, decisions/s): one per statement hot {single_hot:.0f} "
        f"/ 10k {single_10k:.0f}; {pgbench.BATCH} per statement hot {batch_hot:.0f} / 10k "
        f"{batch_10k:.0f}; {reached}"
    )
    report.sections.append(
        "\n".join(
            [
                "## 3. The SQL ceiling: pgbench running lq_admit",
                "",
                "pgbench (C, prepared statements, no Python) calls the project's own",
                "`lq_admit` the way the store does, first with one request per statement",
                f"({'64'} clients), then {pgbench.BATCH} requests per statement (4 clients).",
                "The global layer is on, so every statement locks the global row.",
                "",
                "The last row is the limit of this design: the same 64 requests per",
                "statement over the same rows (each request's tenant layer and the global",
                "layer) as one plain batched bucket update (`bench/pgbench.py`, PLAIN_UPDATE):",
                "rows locked in layer_id order, refilled with lq_refilled and debited in one",
                "`UPDATE ... FROM unnest(...)`, with no per-request decision, reservation row",
                "or answer. What lq_admit spends beyond it is its own work per request.",
                "",
                *rows,
                "",
                "Comparison 1 was not run, so the library's figure is not here."
                if service is None
                else f"The library (comparison 1, 10,000 tenants, 64 callers) decides "
                f"{service:,.0f}/s: {share:.0f}% of the batched "
                "ceiling, measured on the same database in the same run.",
                "",
                f"`{line}`",
                "",
                f"`{sql_line}`",
                "",
                "Throughput above includes waiting for the global row and the WAL flush;",
                "the server CPU one statement costs does not (read from /proc for one",
                "connection's server process, `synchronous_commit` off, the fewest of 3",
                f"rounds of {statements} statements, 10,000 tenants):",
                "",
                f"`{cpu_line}`",
                "",
                "And one request per statement, the batch of a lightly loaded worker:",
                "",
                f"`{single_line}`",
                "",
                f"Settling a batch: the same {pgbench.BATCH} requests admitted and settled in",
                "one statement (`bench/pgbench.py`, ADMITTED_AND_SETTLED), less the",
                "admission alone; 'ok' settlements feed the learned output estimates,",
                "'error' ones do not, and the difference is what the estimates cost:",
                "",
                f"`{settle_line}`",
            ]
        )
    )
    report.line(line, summary=True)
    report.line(sql_line, summary=True)


# -- 4 -----------------------------------------------------------------------------------


async def compare_burst(pg: servers.Postgres, plan: Plan, report: Report) -> None:
    report.line("== 4. accuracy under a burst (the 09:14 incident, scaled down)")
    dsn = await common.fresh_database(pg.dsn, "bench_burst")
    results = []
    for strategy in burst.STRATEGIES:
        result = await burst.run_strategy(
            dsn, strategy, window_s=plan.burst_window_s, speedup=plan.burst_speedup
        )
        results.append(result)
        report.line(
            f"  {strategy:18}: {result.admitted:3} admitted, {result.tokens_admitted:7,} tokens "
            f"= {result.overshoot:.2f}x budget ({result.budget:,.0f})"
        )
    path, link = report.chart("burst.png")
    charts.burst_chart(results, path)
    rows = [
        "| strategy | admitted | tokens admitted | budget | x budget | beyond budget |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        rows.append(
            f"| {r.strategy} | {r.admitted} | {r.tokens_admitted:,} | {r.budget:,.0f} "
            f"| {r.overshoot:.2f} | {r.beyond_budget:,} |"
        )
    by = {r.strategy: r for r in results}
    strict = by["reserve-max-tokens"].beyond_budget + by["reserve + refund"].beyond_budget
    line = (
        "burst overshoot (x budget): "
        + ", ".join(f"{r.strategy} {r.overshoot:.2f}" for r in results)
        + f"; tokens beyond capacity + refill with reservations: {strict}"
    )
    latency = burst.FakeProvider(0.3, burst.SEED_TOKENS_PER_SECOND * plan.burst_speedup)
    report.sections.append(
        "\n".join(
            [
                "## 4. Accuracy under a burst",
                "",
                f"The seeds' 09:14 incident, scaled down: a {burst.CAPACITY_TOKENS:,}-token bucket",
                f"({burst.TOKENS_PER_MINUTE:,} a minute), {burst.REQUESTS} requests inside",
                f"{burst.BURST_SPREAD_S * 1000:.0f} ms, each {burst.INPUT_TOKENS} input tokens "
                "with",
                f"max_tokens {burst.MAX_TOKENS:,}, generating {burst.OUTPUT_RANGE[0]:,}-"
                f"{burst.OUTPUT_RANGE[1]:,} tokens. The fake provider streams "
                f"{plan.burst_speedup:g}x faster than the seed's 63 tokens/s",
                f"(a 2,000-token answer takes {latency.latency_s(2_000):.1f} s instead of 32 s) so",
                "the run takes seconds. Refused requests retry after their hint until the",
                f"{plan.burst_window_s:g} s window closes. Tokens admitted = the real usage of",
                "the requests admitted in the window; budget = capacity + refill over it.",
                "All three strategies run on llmquota's own statements:",
                "debit-on-response reserves nothing and debits at settlement (bench only),",
                "reserve-max-tokens keeps the whole reservation, reserve + refund is the product.",
                "",
                *rows,
                "",
                f"![tokens admitted over time]({link})",
                "",
                f"`{line}`",
            ]
        )
    )
    report.line(line, summary=True)


# -- 5 -----------------------------------------------------------------------------------


async def compare_grid(pg: servers.Postgres, plan: Plan, report: Report) -> None:
    report.line("== 5. the two-axis grid: request rate x completion length")
    dsn = await common.fresh_database(pg.dsn, "bench_grid")
    cells = []
    for length in plan.grid_lengths:
        for rate in plan.grid_rates:
            cell = await grid.run_cell(dsn, rate, length, plan.grid_s)
            cells.append(cell)
            report.line(
                f"  {rate:4}/s x {length:5} tokens: binds {cell.binding:11} "
                f"(first refusal: {cell.first_refusal}) refused {dict(cell.refused)} of {cell.sent}"
            )
    path, link = report.chart("grid.png")
    charts.grid_chart(cells, path)
    counts = Counter(c.binding for c in cells)
    line = "grid: cells where each limit binds: " + ", ".join(
        f"{kind} {counts[kind]}" for kind in grid.KINDS
    )
    p = grid.POLICY
    report.sections.append(
        "\n".join(
            [
                "## 5. The two-axis grid: which limit binds",
                "",
                "Seed 004's load test with both axes. Each cell is an open-loop run of",
                f"{plan.grid_s:g} s through the limiter and the fake provider (first token",
                f"{grid.PROVIDER.first_token_s * 1000:.0f} ms, "
                f"{grid.PROVIDER.tokens_per_second:,.0f} tokens/s, so long completions also hold",
                "permits longer) against one tenant",
                f"with {p.tokens_per_minute:,} tokens/min (burst {p.token_burst:,}), "
                f"{p.requests_per_minute:,} requests/min (burst {p.request_burst}) and "
                f"{p.max_in_flight} in flight; {grid.INPUT_TOKENS} input tokens per request.",
                "A cell names the limit that refused the most requests in it.",
                "",
                f"![binding limit per cell]({link})",
                "",
                f"`{line}`",
            ]
        )
    )
    report.line(line, summary=True)


# -- 6 -----------------------------------------------------------------------------------


async def compare_growth(pg: servers.Postgres, plan: Plan, report: Report) -> None:
    report.line("== 6. cost growth")
    dsn = await common.fresh_database(pg.dsn, "bench_growth")
    small_tenants = await common.seed_tenants(dsn, 100, prefix="s")
    before = await growth.snapshot(
        dsn, "100 tenants, empty ledger", small_tenants, 0, plan.growth_s
    )
    started = time.perf_counter()
    tenants = await growth.grow(dsn, plan.growth)
    grow_s = time.perf_counter() - started
    grown = f"{plan.growth.tenants:,} tenants, {plan.growth.ledger_rows:,} ledger rows"
    # The same 100 tenants first (only the tables grew), then callers spread
    # over every tenant (more distinct rows per batch to lock).
    after = await growth.snapshot(
        dsn, f"{grown}, the same 100 tenants", small_tenants, plan.growth.ledger_rows, plan.growth_s
    )
    spread = await growth.snapshot(
        dsn, f"{grown}, all tenants", tenants, plan.growth.ledger_rows, plan.growth_s
    )
    sweep = await growth.sweep_backlog(dsn, tenants, plan.growth.leases)
    rows = [
        "| database | size MB | 1 caller p50 ms | 1 caller p99 ms | 64 callers /s "
        "| 64 callers p99 ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in (before, after, spread):
        report.line(
            f"  {s.label}: {s.database_mb:.0f} MB, 1 caller p50 {ms(s.one_caller.p50_ms)} ms "
            f"p99 {ms(s.one_caller.p99_ms)} ms, 64 callers {s.callers_64.per_second:.0f}/s "
            f"p99 {ms(s.callers_64.p99_ms)} ms"
        )
        rows.append(
            f"| {s.label} | {s.database_mb:,.0f} | {ms(s.one_caller.p50_ms)} "
            f"| {ms(s.one_caller.p99_ms)} | {s.callers_64.per_second:,.0f} "
            f"| {ms(s.callers_64.p99_ms)} |"
        )
    rate = sweep.expired / sweep.seconds if sweep.seconds else 0.0
    report.line(
        f"  sweeper: {sweep.expired:,} of {sweep.leases:,} expired leases in {sweep.seconds:.2f} s "
        f"({sweep.batches} batches, {rate:,.0f}/s)"
    )
    sizes_note = " (--quick: smaller sizes)" if plan.quick else ""
    line = (
        f"cost growth{sizes_note}: admit p99 {ms(before.one_caller.p99_ms)} -> "
        f"{ms(after.one_caller.p99_ms)} ms (1 caller), {before.callers_64.per_second:.0f} -> "
        f"{after.callers_64.per_second:.0f}/s (64 callers, same tenants; "
        f"{spread.callers_64.per_second:.0f}/s spread over all) after "
        f"{plan.growth.ledger_rows:,} ledger rows and {plan.growth.tenants:,} tenants; db "
        f"{before.database_mb:.0f} -> {spread.database_mb:.0f} MB; sweeper {sweep.expired:,} "
        f"leases in {sweep.seconds:.1f} s"
    )
    report.sections.append(
        "\n".join(
            [
                "## 6. Cost growth",
                "",
                "Admission on a small database, then after growing it: tenants with real",
                "layers, plus finished reservations with one ledger row each (bulk-inserted, "
                f"{grow_s:.0f} s). Callers pick a random tenant per admission.",
                "",
                *rows,
                "",
                f"Sweeper: {sweep.expired:,} of {sweep.leases:,} expired leases reclaimed by one "
                f"`limiter.sweep()` run in {sweep.seconds:.2f} s ({sweep.batches} statements of up "
                f"to {growth.SWEEP_BATCH:,}, {rate:,.0f} leases/s).",
                "",
                f"`{line}`",
            ]
        )
    )
    report.line(line, summary=True)


# -- 7 -----------------------------------------------------------------------------------


def compare_replicas(pg: servers.Postgres, plan: Plan, report: Report) -> None:
    report.line("== 7. past one server: 1, 2 and 3 llmquota serve replicas, one PostgreSQL")
    dsn = asyncio.run(prepare_http_database(pg))
    load = common.machine_load()
    results = []
    for count in scaleout.REPLICAS:
        asyncio.run(common.reset_state(dsn))
        result = scaleout.measure(
            dsn, count, tenants=TENANTS, connections=HTTP_CONNECTIONS, seconds=plan.http_s
        )
        results.append(result)
        report.line(
            f"  {count} replica(s): {result.per_second:8.0f}/s  p99 {ms(result.p99_ms)} ms  "
            f"non-2xx {result.non_2xx}"
        )
    rows = [
        "| replicas | admissions/s | worst p99 ms | non-2xx |",
        "| ---: | ---: | ---: | ---: |",
        *(
            f"| {r.replicas} | {r.per_second:,.0f} | {ms(r.p99_ms)} | {r.non_2xx} |"
            for r in results
        ),
    ]
    line = "replicas 1/2/3: " + "/".join(f"{r.per_second:.0f}" for r in results) + " per s"
    report.sections.append(
        "\n".join(
            [
                "## 7. Past one server: replicas",
                "",
                "1, 2 and 3 separate `llmquota serve --workers 1` processes on their own",
                "ports, one PostgreSQL; one wrk per replica, all at once, "
                f"{HTTP_CONNECTIONS} connections in all,",
                f"{plan.http_s:g} s, 10,000 tenants (POST /v1/admit as in comparison 2). "
                "Replicas hold no state:",
                "`tests/acceptance/test_replicas.py` proves three of them admit exactly what",
                "the limits allow. Here every replica, wrk and PostgreSQL share the same two",
                f"cores ({load} at the start), so the rows show what one database on this",
                "machine takes, not what more machines would add; see docs/scaling.md.",
                "",
                *rows,
                "",
                f"`{line}`",
            ]
        )
    )
    report.line(line, summary=True)


# -- 10 ----------------------------------------------------------------------------------


def compare_shards(pg: servers.Postgres, plan: Plan, report: Report) -> None:
    report.line("== 10. the sharded global layer: K = 1, 2, 4 rows, 2, 4 and 8 statements")
    dsn = asyncio.run(common.fresh_database(pg.dsn, "bench_shards"))
    asyncio.run(shards.prepare(dsn, TENANTS))
    aligned: dict[tuple[int, int], shards.ShardsResult] = {}
    mixed: dict[int, shards.ShardsResult] = {}
    for k in shards.SHARDS:
        per_shard = asyncio.run(shards.set_shards(dsn, k))
        for clients, is_aligned in [(c, True) for c in shards.CLIENTS] + [(8, False)]:
            asyncio.run(common.reset_state(dsn))
            result = shards.run(
                pg,
                "bench_shards",
                shards=k,
                per_shard=per_shard,
                clients=clients,
                aligned=is_aligned,
                tenants=TENANTS,
                seconds=plan.pgbench_s,
            )
            if is_aligned:
                aligned[k, clients] = result
            else:
                mixed[k] = result
            report.line(
                f"  K={k} {clients} statements {'per shard' if is_aligned else 'mixed    '}: "
                f"{result.decisions_per_second:8.0f} decisions/s  p99 {ms(result.p99_ms)} ms"
            )
    head = " | ".join(f"{c} statements: decisions/s, p99 ms" for c in shards.CLIENTS)
    rows = [
        f"| shards | {head} | 8 statements, mixed batches |",
        "| ---: |" + " ---: |" * (len(shards.CLIENTS) + 1),
        *(
            f"| {k} | "
            + " | ".join(
                f"{aligned[k, c].decisions_per_second:,.0f}, {ms(aligned[k, c].p99_ms)}"
                for c in shards.CLIENTS
            )
            + f" | {mixed[k].decisions_per_second:,.0f}, {ms(mixed[k].p99_ms)} |"
            for k in shards.SHARDS
        ),
    ]
    line = (
        "global shards 1/2/4: "
        + "/".join(
            f"{aligned[k, max(shards.CLIENTS)].decisions_per_second:.0f}" for k in shards.SHARDS
        )
        + " per s"
    )
    report.sections.append(
        "\n".join(
            [
                "## 10. The sharded global layer",
                "",
                "pgbench runs `lq_admit` with 64 requests per statement over 10,000 tenants",
                "while the global layer is split over K rows (`shards` on the global policy,",
                "migration 0012). In the per-shard columns each statement's tenants come from",
                "one shard, as a batcher grouping by shard would send them; the last column",
                "draws them from everywhere, so each statement locks every shard. The budget",
                "is large, so no shard runs short (the borrowing path is proven exact in",
                "`tests/integration/test_global_shards.py`, not timed here). p99 is per",
                f"statement, from pgbench's transaction log; {plan.pgbench_s:g} s per cell.",
                "",
                *rows,
                "",
                f"`{line}` (per-shard batches, 8 statements)",
            ]
        )
    )
    report.line(line, summary=True)


# -- the run ---------------------------------------------------------------------------


def header(plan: Plan, pg: servers.Postgres, redis: servers.Redis, load: str) -> str:
    command = COMMAND_QUICK if plan.quick else COMMAND_FULL
    redis_text = redis.description
    return "\n".join(
        [
            "## How this run was measured",
            "",
            f"Measured with `{command}` on "
            f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC. Everything runs",
            "side by side in that one run, so every ratio compares numbers taken minutes",
            "apart on the same machine.",
            "",
            f"- Machine: {platform.machine()}, {load} when the run started (the machine",
            "  is shared with other work, which shows as noise).",
            f"- PostgreSQL: {pg.description}.",
            f"- Redis: {redis_text}.",
            f"- Python {platform.python_version()}, asyncpg; for Redis redis-py (asyncio) with "
            "hiredis and valkey-glide; the default "
            "asyncio event loop.",
        ]
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a run under two minutes")
    parser.add_argument(
        "--postgres",
        choices=("pg15", "embedded"),
        default="pg15" if servers.pg15_available() else "embedded",
        help="Debian's PostgreSQL 15 (default when installed) or the embedded one",
    )
    parser.add_argument(
        "--only",
        type=int,
        nargs="*",
        choices=range(1, 13),
        help="run only these comparisons (1-12)",
    )
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    plan = QUICK if args.quick else FULL
    results_dir = ROOT / "bench" / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    if plan.quick:
        report = Report(results_dir, results_dir / "BENCHMARKS.md")
    else:
        (ROOT / "docs" / "bench").mkdir(parents=True, exist_ok=True)
        report = Report(ROOT / "docs" / "bench", ROOT / "BENCHMARKS.md")
    wanted = set(args.only or range(1, 13))
    servers.ensure_tools()
    started = time.monotonic()
    load = common.machine_load()
    with contextlib.ExitStack() as stack:
        pg = stack.enter_context(servers.postgres(args.postgres))
        redis = stack.enter_context(servers.redis())
        print(f"PostgreSQL: {pg.description}")
        print(f"Redis: {redis.description}")
        service_10k_64: float | None = None
        # Without comparison 1 to find the fastest client, the HTTP baseline
        # takes the one that was fastest in every run so far.
        fastest = redis_lua.CLIENTS_BY_NAME["valkey-glide"]
        if 1 in wanted:
            service_10k_64, fastest = asyncio.run(compare_library(pg, redis, plan, report))
        if 2 in wanted:
            compare_http(pg, redis, fastest, plan, report)
        if 3 in wanted:
            if 1 not in wanted:
                asyncio.run(_library_database(pg))
            compare_sql_ceiling(pg, "bench_library", plan, report, service_10k_64)
        run_sections_4_to_12(pg, wanted, plan, report)
    elapsed = time.monotonic() - started
    footer = f"Run time: {elapsed:.0f} s."
    text = "\n\n".join([header(plan, pg, redis, load), *report.sections, footer]) + "\n"
    write_markdown(report.markdown_path, text)
    print(
        f"wrote {report.markdown_path.relative_to(ROOT)} and charts in "
        f"{report.charts_dir.relative_to(ROOT)} ({elapsed:.0f} s)"
    )
    return 0


def run_sections_4_to_12(
    pg: servers.Postgres, wanted: set[int], plan: Plan, report: Report
) -> None:
    """The comparisons that need no Redis and no result of another."""
    if 4 in wanted:
        asyncio.run(compare_burst(pg, plan, report))
    if 5 in wanted:
        asyncio.run(compare_grid(pg, plan, report))
    if 6 in wanted:
        asyncio.run(compare_growth(pg, plan, report))
    if 7 in wanted:
        compare_replicas(pg, plan, report)
    if 8 in wanted:
        fresh = functools.partial(common.fresh_database, pg.dsn)
        asyncio.run(oversubscription.section(fresh, plan.quick, report))
    if 9 in wanted:
        estimates.section(report)  # simulated time: needs no server
    if 10 in wanted:
        compare_shards(pg, plan, report)
    if 11 in wanted:
        response_cache.section(pg.dsn, plan.quick, report)
    if 12 in wanted:
        fresh = functools.partial(common.fresh_database, pg.dsn)
        asyncio.run(allotment_slack.section(fresh, plan.quick, report))


MARKER = "<!-- Everything below this line is written by bench/run.py. -->"


def write_markdown(path: Path, generated: str) -> None:
    """Replace the generated part of the report; keep what was written above MARKER."""
    kept = "# Benchmarks\n\n"
    if path.exists():
        text = path.read_text()
        if MARKER in text:
            kept = text[: text.index(MARKER)]
    path.write_text(f"{kept}{MARKER}\n\n{generated}")


async def _library_database(pg: servers.Postgres) -> None:
    dsn = await common.fresh_database(pg.dsn, "bench_library")
    await common.seed_tenants(dsn, TENANTS)


if __name__ == "__main__":
    sys.exit(main())
