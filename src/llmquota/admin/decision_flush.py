"""`decision_counts_flushing`: a worker's decision counts into PostgreSQL, every few seconds.

While it runs, Metrics.count_answer counts each answer in the worker's
memory (domain/decision_counts.py); this loop drains that tally every
DECISION_COUNTS_FLUSH_SECONDS and adds it to `decision_counts` with one
statement, which also prunes the minutes older than KEEP_SECONDS. A flush the
database does not take puts its counts back, so an outage delays the chart
and loses nothing (short of the worker stopping); the last counts are flushed
when the worker stops. The chart's counts are at least once: a statement that
committed but whose answer was lost (a timeout after the commit) is added
again by the next flush. They are a picture for the person on call; the
ledger, not this table, is what is billed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from llmquota.domain.decision_counts import DecisionTally
from llmquota.domain.errors import LimiterError
from llmquota.metrics import Metrics
from llmquota.store.console import ConsoleStore

log = logging.getLogger(__name__)

# How long the per-minute counts are kept: two days, pruned by every flush.
KEEP_SECONDS = 2 * 86_400.0


async def flush_decision_counts(tally: DecisionTally, store: ConsoleStore) -> int:
    """Add what the tally counted since the last flush; how many keys were written."""
    counts = tally.drain()
    if not counts:
        return 0
    try:
        await store.add_decision_counts(counts, KEEP_SECONDS)
    except BaseException:
        tally.restore(counts)  # counted again at the next flush
        raise
    return len(counts)


async def _flush_forever(tally: DecisionTally, store: ConsoleStore, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        try:
            await flush_decision_counts(tally, store)
        except (LimiterError, OSError) as exc:
            log.info("decision counts not flushed (kept for the next flush): %s", exc)
        except Exception:
            # Never the end of the loop: the tally would grow until the worker stops.
            log.exception("decision counts not flushed (kept for the next flush)")


@contextlib.asynccontextmanager
async def decision_counts_flushing(
    metrics: Metrics, store: ConsoleStore, interval_seconds: float
) -> AsyncIterator[None]:
    """Count the worker's decisions and flush them every `interval_seconds` for the
    length of the block, and once at its end."""
    tally = metrics.tally = metrics.tally or DecisionTally()
    task = asyncio.create_task(
        _flush_forever(tally, store, interval_seconds), name="llmquota-decision-counts"
    )
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        try:
            await flush_decision_counts(tally, store)
        except (LimiterError, OSError) as exc:
            log.warning("the last decision counts were not flushed: %s", exc)
