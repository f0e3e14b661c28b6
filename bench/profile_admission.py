"""Where the Python CPU of an admission goes: `python bench/profile_admission.py`.

Standalone, not part of bench/run.py: it starts Debian's PostgreSQL 15 (or
the embedded one), seeds 10,000 tenants and runs comparison 1's llmquota
point (64 closed-loop callers, `limiter.admit`, random tenants) for
`--seconds`, then prints the process CPU per admission the way run.py does.
With `--cprofile FILE` the measured window runs under cProfile and the
functions taking the most CPU (own time, and own plus callees) are printed;
cProfile slows everything down, so read its shares, not its microseconds.
For a sampling profile with no such distortion run it under py-spy:
`py-spy record -o profile.svg -- python bench/profile_admission.py`.
`--one-allotted` measures instead one caller admitting from a slice (an
allotted tenant's admissions, decided in this process), best of 5 rounds;
`--one-exact` one caller whose every admission is a statement of its own
(exact, one at a time, as at a low request rate): wall time and process CPU
(user, kernel) per admission, of the round with the least CPU of 5.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import datetime
import os
import pstats
import resource
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[0] = str(ROOT)

from bench import common, library, servers  # noqa: E402
from llmquota import Limiter, settle_after_startup  # noqa: E402
from llmquota.domain.errors import StoreUnavailable  # noqa: E402
from llmquota.domain.records import AdmitDecision, AdmitRequest  # noqa: E402
from llmquota.store.decisions import ADMIT_COLUMNS, admit_arguments, admit_decision  # noqa: E402

TENANTS = 10_000
CALLERS = 64
# Lines of the cProfile tables printed.
TOP_FUNCTIONS = 30
# Admissions per round of `--one-allotted`.
ONE_CALLER_ADMISSIONS = 40_000
# Admissions per round of `--one-exact` (each a round trip), and its tenants.
ONE_EXACT_ADMISSIONS = 1_500
ONE_EXACT_TENANTS = 1_000


def batch_sizes(limiter: Limiter) -> tuple[float, float]:
    """(admission batches, requests in them) this limiter has sent so far."""
    count = total = 0.0
    for metric in limiter.metrics.batch_size.collect():
        for sample in metric.samples:
            if sample.labels.get("operation") == "admit":
                if sample.name.endswith("_count"):
                    count = sample.value
                elif sample.name.endswith("_sum"):
                    total = sample.value
    return count, total


async def measure(dsn: str, seconds: float, profile: cProfile.Profile | None) -> None:
    tenants = await common.seed_tenants(dsn, TENANTS)
    limiters: list[Limiter] = []
    connect = Limiter.connect

    async def remembered(*args: Any, **kwargs: Any) -> Limiter:
        limiter = await connect(*args, **kwargs)
        limiters.append(limiter)
        return limiter

    Limiter.connect = remembered  # type: ignore[method-assign]
    # A short unprofiled point first: connections, caches and plans warm up.
    await library.llmquota_point(
        dsn, library.LLMQUOTA, workload="10k", tenants=tenants, callers=CALLERS, seconds=1.0
    )
    before = os.times()
    if profile is not None:
        profile.enable()
    try:
        point = await library.llmquota_point(
            dsn,
            library.LLMQUOTA,
            workload="10k",
            tenants=tenants,
            callers=CALLERS,
            seconds=seconds,
        )
    finally:
        if profile is not None:
            profile.disable()
    after = os.times()
    result = point.result
    # The whole point, warm-up included: the share of kernel time in the CPU.
    user, system = after.user - before.user, after.system - before.system
    batches, requests = batch_sizes(limiters[-1])
    print(
        f"llmquota 10k tenants {CALLERS} callers: {result.per_second:.0f}/s  "
        f"p50 {result.p50_ms:.2f} ms  p99 {result.p99_ms:.2f} ms  "
        f"python cpu {result.cpu_us_per_call:.1f} us per admission, "
        f"{requests / batches if batches else 0:.1f} per batch, "
        f"{100 * system / (user + system):.0f}% of it in the kernel ({common.machine_load()})"
    )


async def measure_one_allotted(dsn: str, rounds: int, profile: cProfile.Profile | None) -> None:
    """`--one-allotted`: one caller, one tenant whose policy is allotted, a slice with
    room: the process CPU of `limiter.admit` and the `asyncio.sleep(0)` after it,
    best of `rounds` x ONE_CALLER_ADMISSIONS (BENCHMARKS.md, issue 25's eighth part)."""
    tenants = await common.seed_tenants(dsn, 10)
    await common.reset_state(dsn, admission="allotted")
    limiter = await Limiter.connect(dsn, library.ALLOTTED.settings())
    request = {"tenant": tenants[0], "model": "gpt-4o", "input_tokens": 300, "max_tokens": 2000}
    try:
        for _ in range(5_000):  # the slice taken and grown, the plans warm
            await limiter.admit(**request)  # type: ignore[arg-type]
            await asyncio.sleep(0)
        settle_after_startup()
        if profile is not None:
            profile.enable()
        per_call = []
        for _ in range(rounds):
            before = time.process_time()
            for _ in range(ONE_CALLER_ADMISSIONS):
                await limiter.admit(**request)  # type: ignore[arg-type]
                await asyncio.sleep(0)
            per_call.append((time.process_time() - before) / ONE_CALLER_ADMISSIONS * 1e6)
        if profile is not None:
            profile.disable()
    finally:
        await limiter.close()
    print(
        f"llmquota allotted, one caller: python cpu {min(per_call):.2f} us per admission "
        f"(best of {rounds}: {' '.join(f'{x:.2f}' for x in per_call)}; {common.machine_load()})"
    )


class NoDatabase:
    """A store that decides every batch without PostgreSQL: `--no-database`.

    Its admit builds lq_admit's arguments and parses made-up rows with the
    store's own functions (store/decisions.py) after one turn of the loop,
    so what remains is the library's Python per admission without asyncpg,
    the socket and the database: the part this profile is about, measured
    without the noise of a database sharing the cores.
    """

    def __init__(self) -> None:
        self.estimates = self
        self.cell_index: int | None = None  # not a database of cells
        self.dsn = None  # no database to LISTEN on: the change listener does not start

    async def admit(
        self,
        requests: Sequence[AdmitRequest],
        *,
        deadline_seconds: float | None = None,
        reservation_ids: Sequence[uuid.UUID] | None = None,
    ) -> list[AdmitDecision]:
        admit_arguments(requests, 1_000)
        await asyncio.sleep(0)
        expires = datetime.datetime.now(datetime.UTC)
        ids = reservation_ids or [uuid.uuid4() for _ in requests]
        rows = (_admitted_row(r, expires, i) for r, i in zip(requests, ids, strict=True))
        return [admit_decision(row) for row in rows]

    async def close(self) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        async def unavailable(*args: Any, **kwargs: Any) -> Any:
            raise StoreUnavailable(f"no database: {name}")

        return unavailable


def _admitted_row(
    request: AdmitRequest, expires: datetime.datetime, reservation_id: uuid.UUID
) -> tuple[Any, ...]:
    """An admitted row of lq_admit, by position (ADMIT_COLUMNS) as asyncpg gives it."""
    row: dict[str, Any] = dict.fromkeys(ADMIT_COLUMNS)
    row.update(
        status="admitted",
        reservation_id=reservation_id,
        reserved_tokens=request.input_tokens + request.max_tokens,
        lease_expires_at=expires,
        lease_generation=1,
        model=request.model,
        input_tokens=request.input_tokens,
        degraded=False,
    )
    return tuple(row.values())


async def measure_without_database(seconds: float, profile: cProfile.Profile | None) -> None:
    """64 callers admitting against NoDatabase: the library's own CPU per admission."""
    settings = library.LLMQUOTA.settings()
    limiter = Limiter(NoDatabase(), settings)  # type: ignore[arg-type]
    tenants = [f"t{i}" for i in range(TENANTS)]
    picks = [library.tenant_picker("10k", tenants, seed) for seed in range(CALLERS)]
    counters = [0] * CALLERS

    async def call(index: int) -> bool:
        sequence = picks[index]
        counters[index] += 1
        await limiter.admit(
            tenant=sequence[counters[index] % len(sequence)],
            model="gpt-4o",
            input_tokens=library.INPUT_TOKENS,
            max_tokens=library.MAX_TOKENS,
        )
        return True

    await common.closed_loop(call, CALLERS, 1.0, warmup_s=0.3)
    if profile is not None:
        profile.enable()
    try:
        result = await common.closed_loop(call, CALLERS, seconds, warmup_s=0.3)
    finally:
        if profile is not None:
            profile.disable()
        await limiter.close()
    print(
        f"llmquota without a database, {CALLERS} callers: {result.per_second:.0f}/s  "
        f"python cpu {result.cpu_us_per_call:.1f} us per admission ({common.machine_load()})"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--cprofile", type=Path, help="profile the window into this file")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--no-database",
        action="store_true",
        help="decide against a store that answers at once (the library's own Python only)",
    )
    mode.add_argument(
        "--one-allotted",
        action="store_true",
        help="one caller admitting from a slice (allotted): CPU per admission, best of 5 rounds",
    )
    mode.add_argument(
        "--one-exact",
        action="store_true",
        help="one caller, exact admissions one at a time: wall and CPU per admission",
    )
    parser.add_argument(
        "--postgres",
        choices=("pg15", "embedded"),
        default="pg15" if servers.pg15_available() else "embedded",
    )
    args = parser.parse_args()
    profile = cProfile.Profile() if args.cprofile else None
    if args.no_database:
        asyncio.run(measure_without_database(args.seconds, profile))
    else:
        run_with_database(
            args.postgres,
            args.seconds,
            profile,
            one_allotted=args.one_allotted,
            one_exact=args.one_exact,
        )
    if profile is not None:
        profile.dump_stats(args.cprofile)
        stats = pstats.Stats(str(args.cprofile))
        stats.sort_stats("tottime").print_stats(TOP_FUNCTIONS)
        stats.sort_stats("cumulative").print_stats(TOP_FUNCTIONS)
    return 0


async def measure_one_exact(dsn: str, rounds: int, profile: cProfile.Profile | None) -> None:
    """`--one-exact`: one caller, exact admissions one at a time over
    ONE_EXACT_TENANTS tenants, so each is a batch of one: wall time and process
    CPU per admission, the round with the least CPU of `rounds` (BENCHMARKS.md,
    issue 25's ninth part)."""
    tenants = await common.seed_tenants(dsn, ONE_EXACT_TENANTS)
    limiter = await Limiter.connect(dsn, library.LLMQUOTA.settings())
    requests = [
        {"tenant": tenant, "model": "gpt-4o", "input_tokens": 300, "max_tokens": 2000}
        for tenant in tenants
    ]
    try:
        for request in requests:  # connections, caches and plans warm
            await limiter.admit(**request)  # type: ignore[arg-type]
        settle_after_startup()
        if profile is not None:
            profile.enable()
        # Per round, in us per admission: (CPU, user, kernel, wall). getrusage
        # counts microseconds (os.times 10 ms ticks: 6.7 us over a round).
        measured: list[tuple[float, float, float, float]] = []
        for _ in range(rounds):
            started, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
            for index in range(ONE_EXACT_ADMISSIONS):
                await limiter.admit(**requests[index % len(requests)])  # type: ignore[arg-type]
            wall = time.perf_counter() - started
            after = resource.getrusage(resource.RUSAGE_SELF)
            user, system = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
            per = 1e6 / ONE_EXACT_ADMISSIONS
            measured.append((per * (user + system), per * user, per * system, per * wall))
        if profile is not None:
            profile.disable()
    finally:
        await limiter.close()
    cpu, user_us, system_us, wall_us = min(measured)
    print(
        f"llmquota exact, one caller, one at a time: wall {wall_us:.0f} us, python cpu "
        f"{cpu:.0f} us per admission (user {user_us:.0f}, kernel {system_us:.0f}; the "
        f"round with the least CPU of {rounds}; {common.machine_load()})"
    )


def run_with_database(
    kind: str,
    seconds: float,
    profile: cProfile.Profile | None,
    *,
    one_allotted: bool = False,
    one_exact: bool = False,
) -> None:
    with servers.postgres(kind) as pg:
        dsn = asyncio.run(common.fresh_database(pg.dsn, "bench_profile"))
        if one_allotted:
            asyncio.run(measure_one_allotted(dsn, 5, profile))
        elif one_exact:
            asyncio.run(measure_one_exact(dsn, 5, profile))
        else:
            asyncio.run(measure(dsn, seconds, profile))


if __name__ == "__main__":
    sys.exit(main())
