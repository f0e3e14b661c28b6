"""`llmquota estimates`: the learned output distributions admission reserves from.

One row per (tenant, route, model) whose completions were recorded at
settlement: how many samples count (since the histogram last decayed to
nothing), their decayed weight, the p50/p95/p99 of the output tokens (each
the top of its histogram bucket, so at most an eighth above the true
quantile) and when the last sample arrived.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from datetime import UTC, datetime
from typing import Any

from llmquota.cli.options import add_flag
from llmquota.cli.tabular import FORMATS, render
from llmquota.config import Settings
from llmquota.domain.errors import InvalidRequest
from llmquota.domain.validation import check_model, check_name
from llmquota.store.database import open_database

COLUMNS = ("tenant", "route", "model", "samples", "weight", "p50", "p95", "p99", "as_of")
# The most rows one listing prints: narrow it with --tenant or --model.
MAX_ROWS = 10_000


def cmd_estimates(args: argparse.Namespace, settings: Settings) -> int:
    """Print the learned output distributions."""
    from llmquota.store.store import Store

    try:
        if args.tenant is not None:
            check_name("--tenant", args.tenant)
        if args.model is not None:
            check_model(args.model, "--model")
    except InvalidRequest as exc:
        print(f"llmquota: error: {exc}", file=sys.stderr)
        return 2

    async def run(dsn: str) -> list[tuple[Any, ...]]:
        store = await Store.connect(
            dsn, min_size=1, max_size=1, transaction_pooler=settings.transaction_pooler
        )
        try:
            read = await store.estimates.histograms(
                tenant=args.tenant, model=args.model, limit=MAX_ROWS
            )
        finally:
            await store.close()
        return [
            (
                h.tenant,
                h.route,
                h.model,
                h.histogram.samples,
                round(h.histogram.effective_samples, 2),
                h.histogram.quantile(0.50),
                h.histogram.quantile(0.95),
                h.histogram.quantile(0.99),
                datetime.fromtimestamp(h.histogram.updated_at, UTC),
            )
            for h in read.histograms
        ]

    with open_database(settings.database_url, settings.data_dir) as db:
        rows = asyncio.run(run(db.dsn))
    sys.stdout.write(render(COLUMNS, rows, args.format))
    return 0


def add_estimates_command(commands: Any) -> None:
    """`estimates [--tenant] [--model] [--format]`."""
    estimates = commands.add_parser(
        "estimates",
        help="print the learned output distributions (samples, p50/p95/p99, as of)",
    )
    add_flag(estimates, "estimates", "--tenant")
    add_flag(estimates, "estimates", "--model")
    add_flag(estimates, "estimates", "--format", choices=FORMATS)
    estimates.set_defaults(func=cmd_estimates)
