"""`llmquota sweep`, `audit` and `tokens`: upkeep and inspection."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmquota.cli.options import add_converted_flag, add_flag, ascii_integer
from llmquota.config import Settings
from llmquota.store.database import open_database

if TYPE_CHECKING:
    from llmquota.admin.sweeper import Sweeper


def cmd_sweep(args: argparse.Namespace, settings: Settings) -> int:
    """Expire reservations whose lease ran out; once, or every --loop seconds.
    In a database of cells (its `public` DSN), every cell is swept, and with
    --loop one ceiling alert detector watches the cells' slices added up; at
    one cell's DSN, none does (a cell holds a slice of each ceiling)."""
    from llmquota.admin.ceilings_over_cells import ceiling_alerts_over_cells
    from llmquota.store.cells import deployments_of

    async def run(dsn: str) -> None:
        deployments = await deployments_of(dsn)
        cells = deployments[0][0] is not None
        each = settings.model_copy(update={"ceiling_alerts": False}) if cells else settings
        async with contextlib.AsyncExitStack() as stack:
            sweepers = [
                (cell, await stack.enter_async_context(_sweeping(cell_dsn, args, each)))
                for cell, cell_dsn in deployments
            ]
            if cells and args.loop and deployments[0][1] != dsn:  # the database's own DSN
                stores = [sweeper.store for _cell, sweeper in sweepers]
                await stack.enter_async_context(ceiling_alerts_over_cells(stores, settings))
            elif cells and args.loop:
                print("ceiling alerts: watched whole at the database's DSN, not per cell")
            await _sweep_loop(sweepers, args)

    with open_database(settings.database_url, settings.data_dir) as db:
        try:
            asyncio.run(run(db.dsn))
        except KeyboardInterrupt:
            return 130
    return 0


@contextlib.asynccontextmanager
async def _sweeping(
    dsn: str, args: argparse.Namespace, settings: Settings
) -> AsyncIterator[Sweeper]:
    """A sweeper of the deployment at `dsn`; with --loop, its alert delivery and
    ceiling alert detector beside it, as `serve` runs them."""
    from llmquota.admin.ceiling_alerts import ceiling_alerts_running
    from llmquota.admin.sweeper import Sweeper
    from llmquota.api.webhooks import delivery_running
    from llmquota.store.alerts import AlertStore
    from llmquota.store.store import Store

    # One statement at a time: a pool of one is all the sweeper needs (a
    # second and a third connection for the alert delivery loop and the
    # ceiling alert detector that run beside it).
    store = await Store.connect(
        dsn,
        min_size=1,
        max_size=3 if args.loop else 1,
        statement_timeout_ms=settings.statement_timeout_ms,
        lock_timeout_ms=settings.lock_timeout_ms,
        transaction_pooler=settings.transaction_pooler,
    )
    sweeper = Sweeper(store, settings)
    try:
        if args.loop:
            alerts = AlertStore(
                store.pool, deadline_seconds=settings.statement_timeout_ms / 1000.0 + 1.0
            )
            async with (
                delivery_running(alerts, settings, sweeper.metrics),
                ceiling_alerts_running(store.catalog, alerts, settings),
            ):
                yield sweeper
        else:
            yield sweeper
    finally:
        await store.close()


async def _sweep_loop(sweepers: list[tuple[str | None, Sweeper]], args: argparse.Namespace) -> None:
    """Sweep once, or every --loop seconds, outliving outages when looping."""
    from llmquota.domain.errors import StoreUnavailable

    while True:
        swept = True
        for cell, sweeper in sweepers:
            # In a database of cells, each line says which cell it swept.
            which = "" if cell is None else f" cell={cell}"
            try:
                report = await sweeper.sweep(args.batch_size, args.max_batches)
            except StoreUnavailable as exc:
                if not args.loop:
                    raise
                # A sweeper loop outlives an outage: try again next round.
                print(f"sweep skipped:{which} {exc}", flush=True)
                swept = False
                continue
            print(
                f"swept: expired={report.expired} tokens_returned={report.tokens_returned} "
                f"batches={report.batches} purged={report.purged} "
                f"partitions_created={report.partitions_created} "
                f"cache_entries_expired={report.cache_entries_expired} "
                f"slices_returned={report.slices_returned}{which}",
                flush=True,
            )
        if args.heartbeat_file and swept:
            # A container healthcheck reads this file's age: a round that
            # missed a deployment leaves it to grow old.
            await asyncio.to_thread(Path(args.heartbeat_file).write_text, f"{time.time():.0f}\n")
        if not args.loop:
            return
        await asyncio.sleep(args.loop)


def cmd_audit(args: argparse.Namespace, settings: Settings) -> int:
    """Recompute the books from the journal (lq_audit: permits, layers, ledger rows,
    credits, quota windows); print each drift by name and exit 1 on any. In a
    database of cells (its `public` DSN), every cell is audited."""
    from llmquota.store.cells import deployments_of
    from llmquota.store.store import Store

    async def run(dsn: str) -> int:
        kinds: Counter[str] = Counter()
        for cell, cell_dsn in await deployments_of(dsn):
            store = await Store.connect(
                cell_dsn, min_size=1, max_size=1, transaction_pooler=settings.transaction_pooler
            )
            try:
                summary = await store.audit_summary()
                findings = await store.audit()
            finally:
                await store.close()
            # In a database of cells, each line says which cell it is about.
            which = "" if cell is None else f" cell={cell}"
            print(
                f"journal: active={summary.active} reserved_tokens={summary.reserved_tokens} "
                f"finished={summary.finished} outage_admissions={summary.outage_admissions} "
                f"ledger_rows={summary.ledger_rows}{which}"
            )
            for f in findings:
                print(
                    f"DRIFT {f.check_name} {f.subject}: expected {f.expected}, "
                    f"found {f.actual}{which}"
                )
            kinds.update(f.check_name for f in findings)
        if not kinds:
            print("no drift")
            return 0
        # Each kind of drift by name, so a page of DRIFT lines still says what broke.
        print(f"drift: {kinds.total()} ({', '.join(f'{k} {n}' for k, n in sorted(kinds.items()))})")
        return 1

    with open_database(settings.database_url, settings.data_dir) as db:
        return asyncio.run(run(db.dsn))


def cmd_tokens(args: argparse.Namespace, settings: Settings) -> int:
    """Count the tokens of stdin as `model` would see them."""
    from llmquota.domain.tokens import count_text

    count = count_text(sys.stdin.read(), args.model, settings.estimate_factors)
    suffix = f" (estimated, {count.encoding})" if count.estimated else f" ({count.encoding})"
    print(f"{count.tokens}{suffix}")
    return 0


def add_maintenance_commands(commands: Any) -> None:
    """`sweep`, `audit` and `tokens`."""
    sweep = commands.add_parser("sweep", help="expire reservations whose lease ran out")
    add_converted_flag(sweep, "sweep", "--loop", float, type=float, metavar="SECONDS")
    # Their variables are Settings fields: None leaves the sweeper to the settings.
    add_flag(sweep, "sweep", "--batch-size", type=ascii_integer)
    add_flag(sweep, "sweep", "--max-batches", type=ascii_integer)
    add_flag(sweep, "sweep", "--heartbeat-file", metavar="PATH")
    sweep.set_defaults(func=cmd_sweep)

    audit = commands.add_parser(
        "audit",
        help="recompute permits, layers, ledger rows, credit balances and quota windows "
        "from the journal, and credits charged against the invoice; exit 1 when anything "
        "drifted",
    )
    audit.set_defaults(func=cmd_audit)

    tokens = commands.add_parser("tokens", help="count the tokens of stdin")
    tokens.add_argument("--model", required=True, help="model name, e.g. gpt-4o")
    tokens.set_defaults(func=cmd_tokens)
