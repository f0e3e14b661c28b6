"""`llmquota rebalance`: move unused room and free in-flight permits between the
cells' slices of shared limits.

A database of cells (`llmquota migrate --cells K`) serves each cell from a
service of its own, and a cell's slice of the global layer (or of a provider
ceiling) runs dry while another's sits full. The library's router
rebalances on its own (admission/cells.py); a deployment of services runs
this command beside them, once (cron) or with --loop, as it runs `sweep`.
Each round is admission/rebalancer.py's.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import TYPE_CHECKING, Any

from llmquota.cli.options import add_converted_flag
from llmquota.config import Settings
from llmquota.store.database import open_database

if TYPE_CHECKING:
    from llmquota.admission.rebalancer import SliceRebalancer


def cmd_rebalance(args: argparse.Namespace, settings: Settings) -> int:
    """One round over the cells, or one every --loop seconds; exit 2 without cells."""
    from llmquota.admission.rebalancer import REBALANCER_LOCK_NAME, SliceRebalancer
    from llmquota.store.cells import CellsError, cells_in, in_cell
    from llmquota.store.leader import LeaderLock
    from llmquota.store.store import Store

    async def run(dsn: str) -> int:
        try:
            names = await cells_in(dsn)
        except CellsError as error:
            print(f"llmquota rebalance: {error}", file=sys.stderr)
            return 2
        if not names:
            print("llmquota rebalance: this database holds no cells", file=sys.stderr)
            return 2
        stores = [
            await Store.connect(
                in_cell(dsn, name),
                min_size=1,
                max_size=1,
                statement_timeout_ms=settings.statement_timeout_ms,
                lock_timeout_ms=settings.lock_timeout_ms,
                transaction_pooler=settings.transaction_pooler,
            )
            for name in names
        ]
        rebalancer = SliceRebalancer(
            [(name, store.budget_moves) for name, store in zip(names, stores, strict=True)],
            leader=LeaderLock(dsn, REBALANCER_LOCK_NAME),
        )
        try:
            await _rounds(rebalancer, args.loop)
        finally:
            await rebalancer.stop()
            await asyncio.gather(*(store.close() for store in stores))
        return 0

    with open_database(settings.database_url, settings.data_dir) as db:
        try:
            return asyncio.run(run(db.dsn))
        except KeyboardInterrupt:
            return 130


async def _rounds(rebalancer: SliceRebalancer, loop: float | None) -> None:
    """One round, or one every `loop` seconds while this process leads."""
    while True:
        try:
            if not await rebalancer.lead():
                print("rebalance skipped: another process rebalances these cells", flush=True)
            else:
                report = await rebalancer.run_round()
                print(
                    f"rebalanced: redelivered={report.redelivered} moves={report.moves} "
                    f"tokens={report.tokens:.0f} requests={report.requests:.2f} "
                    f"permits={report.permits}",
                    flush=True,
                )
        except Exception as exc:
            if not loop:
                raise
            # A loop outlives a cell that does not answer: what a round
            # sent is delivered by the next.
            print(f"rebalance skipped: {exc}", flush=True)
        if not loop:
            return
        await asyncio.sleep(loop)


def add_cells_commands(commands: Any) -> None:
    """`rebalance`."""
    rebalance = commands.add_parser(
        "rebalance",
        help="move unused room between the slices of shared limits (global, provider "
        "ceilings) of a database of cells (`migrate --cells`): once, or every --loop seconds",
    )
    add_converted_flag(rebalance, "rebalance", "--loop", float, type=float, metavar="SECONDS")
    rebalance.set_defaults(func=cmd_rebalance)
