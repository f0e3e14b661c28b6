"""What a layer's policy rules cost each statement: `python bench/policy_rules.py`.

Standalone, not part of bench/run.py. Migration 0036 moved 27 of the 32
CHECK constraints of `limit_layers` into a trigger that only policy writes
fire (migrations/versions/0036_layer_policy_rules.py). This measures it
side by side on one PostgreSQL: two databases migrated to head, 10,000
tenants each, one of them taken back to revision 0035 (the CHECKs, as
before). Each round alternates between them and prints the server CPU per
statement (bench.pgbench.statement_cpu_ms, the fewest of 5 runs of 300) of
`lq_admit`, and of `lq_admit` and `lq_finish` in one statement (admitted,
then settled), for 1, 8 and 64 requests per statement. Before the rounds, the
wall time of seeding the tenants' layers in one INSERT (a policy write of
10,000 rows, which now fires the trigger on each) is printed for both.

Summary line, the medians of the rounds for one request per statement:
`policy rules in a trigger, 1 request: admit X ms (checks Y ms), admit+settle X ms (checks Y ms)`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[0] = str(ROOT)

from alembic import command  # noqa: E402

from bench import common, pgbench, servers  # noqa: E402
from llmquota.store import migrate  # noqa: E402

TENANTS = 10_000
BATCHES = (1, 8, 64)
STATEMENTS = 300
RUNS = 5
# Which database is which: the trigger (head), the CHECKs (0035).
SYSTEMS = ("trigger", "checks")


async def _database(server_dsn: str, system: str) -> tuple[str, float]:
    """A database for `system`, and the seconds its tenants' layers took to write."""
    dsn = await common.fresh_database(server_dsn, f"policy_rules_{system}")
    if system == "checks":
        await asyncio.to_thread(command.downgrade, migrate.alembic_config(dsn), "0035")
    started = time.perf_counter()
    await common.seed_tenants(dsn, TENANTS)
    return dsn, time.perf_counter() - started


def _cpu_ms(dsn: str, batch: int) -> tuple[float, float]:
    """Server CPU ms per admit statement, and per admit-and-settle statement."""
    admit = pgbench.statement_cpu_ms(
        dsn, pgbench.statement(TENANTS, batch), statements=STATEMENTS, rounds=RUNS
    )
    both = pgbench.statement_cpu_ms(
        dsn,
        pgbench.settle_script(TENANTS, batch, outcome="ok"),
        statements=STATEMENTS,
        rounds=RUNS,
    )
    return admit, both


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--postgres", choices=("pg15", "embedded"), default="embedded")
    args = parser.parse_args()
    with servers.postgres(args.postgres) as pg:
        dsns: dict[str, str] = {}
        for system in SYSTEMS:
            dsns[system], seeded = asyncio.run(_database(pg.dsn, system))
            print(f"{system}: {TENANTS:,} tenant layers written in {seeded:.2f} s", flush=True)
        single: dict[str, list[tuple[float, float]]] = {system: [] for system in SYSTEMS}
        for round_ in range(args.rounds):
            for batch in BATCHES:
                line = []
                for system in SYSTEMS:
                    admit, settle = _cpu_ms(dsns[system], batch)
                    if batch == 1:
                        single[system].append((admit, settle))
                    line.append(f"{system} admit {admit:.3f} admit+settle {settle:.3f}")
                print(f"round {round_ + 1}, {batch} per statement: " + "; ".join(line), flush=True)
    medians = {
        system: tuple(statistics.median(pair[i] for pair in single[system]) for i in (0, 1))
        for system in SYSTEMS
    }
    (admit, settle), (checked_admit, checked_settle) = medians["trigger"], medians["checks"]
    print(
        f"policy rules in a trigger, 1 request: admit {admit:.3f} ms"
        f" (checks {checked_admit:.3f} ms), admit+settle {settle:.3f} ms"
        f" (checks {checked_settle:.3f} ms)"
        f" [{common.machine_load()}]"
    )


if __name__ == "__main__":
    main()
