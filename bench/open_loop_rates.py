"""Latency and CPU per request by open-loop rate: `python bench/open_loop_rates.py`.

Standalone, not part of bench/run.py. Comparison 2 measures one rate,
1,000 requests/s; this runs bench/open_loop.py at several (50, 200, 500 and
1,000 by default) against `llmquota serve` on one worker and on two, the raw
ASGI Redis-Lua baseline on two (valkey-glide) and bench/bare_asgi.py (the
cheapest answer on the same uvicorn), each over 10,000 tenants, and prints
for each rate the p50, the p99 and the CPU per request of the server's
processes and of its store's (bench/process_cpu.py). What each spends with
no requests at all (reloads, the sweeper, PostgreSQL's own background
processes) is measured once per server after a pause and taken off, so that
a low rate's figures are the requests' own. It is how issue 25's tenth part
(BENCHMARKS.md) split a low rate's latency into what every process pays for
waking up and what each request costs the two cores.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[0] = str(ROOT)

from bench import common, http_admission, open_loop, process_cpu, servers  # noqa: E402

TENANTS = 10_000
# Seconds of wrk before the first rate: both workers load their encodings and pools.
WARM_UP_SECONDS = 2.0
# After the warm-up, a pause for its own aftermath (autovacuum, WAL), then the
# window over which what each process tree spends idle is measured.
SETTLE_SECONDS = 5.0
IDLE_SECONDS = 5.0


def idle_cpu_per_second(pids: tuple[int, int]) -> tuple[float, float]:
    """CPU seconds per second each tree spends with no requests at all."""
    before = [process_cpu.tree_cpu_seconds(pid) for pid in pids]
    time.sleep(IDLE_SECONDS)
    after = [process_cpu.tree_cpu_seconds(pid) for pid in pids]
    server, store = ((a - b) / IDLE_SECONDS for a, b in zip(after, before, strict=True))
    return server, store


def sweep(
    label: str,
    start: Callable[[], http_admission.Started],
    store_pid: int | None,
    rates: list[int],
    seconds: float,
) -> None:
    """One server, every rate in turn; one line."""
    process, port = start()
    # Without a store of its own, the second tree is the server again (counted once).
    pids = (process.pid, store_pid if store_pid is not None else process.pid)
    try:
        http_admission.run_wrk(
            port,
            system=label,
            workload="warm-up",
            tenants=2,
            connections=64,
            seconds=WARM_UP_SECONDS,
        )
        time.sleep(SETTLE_SECONDS)
        idle = idle_cpu_per_second(pids)
        parts = []
        for rate in rates:
            started = time.monotonic()
            result = http_admission.run_open_loop(
                port, system=label, tenants=TENANTS, rate=rate, seconds=seconds, cpu_of=pids
            )
            # What the trees spend idle, over the run and per request sent, taken off.
            wall = time.monotonic() - started
            sent = round((seconds + open_loop.WARMUP_SECONDS) * rate)
            idle_server, idle_store = (spent * wall * 1e6 / sent for spent in idle)
            server = (result.server_cpu_us or 0.0) - idle_server
            stored = 0.0 if store_pid is None else (result.store_cpu_us or 0.0) - idle_store
            errors = f", {result.non_2xx} errors" if result.non_2xx else ""
            parts.append(
                f"{rate}/s p50 {result.p50_ms:.2f} p99 {result.p99_ms:.2f} ms "
                f"cpu {server:,.0f}+{stored:,.0f} us{errors}"
            )
        idle_store_ms = 0.0 if store_pid is None else idle[1] * 1e3
        parts.append(f"idle {idle[0] * 1e3:.1f}+{idle_store_ms:.1f} ms/s")
        print(f"{label}: " + " | ".join(parts), flush=True)
    finally:
        http_admission.stop(process)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", type=int, nargs="+", default=[50, 200, 500, 1_000])
    parser.add_argument("--seconds", type=float, default=5.0, help="per rate, after 1 s of warm-up")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--postgres",
        choices=("pg15", "embedded"),
        default="pg15" if servers.pg15_available() else "embedded",
    )
    args = parser.parse_args()
    with servers.postgres(args.postgres) as pg, servers.redis() as redis:
        dsn = asyncio.run(common.fresh_database(pg.dsn, "bench_rates"))
        asyncio.run(common.seed_tenants(dsn, TENANTS))
        print(
            "open loop by rate: p50, p99, cpu per request (server + store); "
            f"{pg.description}; {common.machine_load()}",
            flush=True,
        )
        raw_app, postgres = "bench.raw_baseline_app:app", pg.postmaster_pid()
        systems: list[tuple[str, Callable[[], http_admission.Started], int | None]] = [
            ("llmquota serve, 1 worker", lambda: http_admission.start_llmquota(dsn, 1), postgres),
            ("llmquota serve, 2 workers", lambda: http_admission.start_llmquota(dsn, 2), postgres),
            (
                "raw ASGI + Redis-Lua, 2 workers",
                lambda: http_admission.start_baseline(
                    redis.host, redis.port, "valkey-glide", app=raw_app
                ),
                redis.pid,
            ),
            ("bare ASGI, 2 workers", lambda: http_admission.start_bare_asgi(2), None),
        ]
        for _ in range(args.rounds):
            for label, start, store_pid in systems:
                sweep(label, start, store_pid, args.rates, args.seconds)
        print(common.machine_load(), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
