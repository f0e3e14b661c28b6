"""Decision counts: each worker's tally reaches PostgreSQL in one upsert per flush.

Two workers (two limiters, each with its own pool) decide for the same
tenants in the same minutes and flush at the same time: the table holds the
sum of both, exactly, and the minutes older than the kept two days go.
"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta

import asyncpg

from llmquota.admin.decision_flush import KEEP_SECONDS, flush_decision_counts
from llmquota.admission.limiter import Limiter
from llmquota.config import Settings
from llmquota.domain.decision_counts import DecisionTally, minute_datetime, minute_of
from llmquota.store.console import ConsoleStore
from tests.integration.support import put


async def _decide(limiter: Limiter, tenant: str, tokens: int, times: int) -> list[str]:
    answers = []
    for _ in range(times):
        admission = await limiter.decide(
            limiter.prepare(tenant=tenant, model="gpt-4o", input_tokens=tokens, max_tokens=0)
        )
        answers.append(admission.decision.status)
    return answers


async def test_two_workers_flushing_the_same_keys_add_up_exactly(
    limiter: Limiter, app_dsn: str, settings: Settings, db: asyncpg.Connection
) -> None:
    await put(limiter, "tenant", "acme", tokens_per_minute=60, token_burst=1_000)
    await limiter.refresh_policies()
    other = await Limiter.connect(app_dsn, settings)
    tallies = [DecisionTally(), DecisionTally()]  # as the server's flush loop sets them
    limiter.metrics.tally, other.metrics.tally = tallies
    try:
        first = await _decide(limiter, "acme", 300, 5)  # 3 fit, 2 refused
        second = await _decide(other, "acme", 300, 4)
        stores = [ConsoleStore(lim.store.pool) for lim in (limiter, other)]
        written = await asyncio.gather(
            *(
                flush_decision_counts(tally, store)
                for tally, store in zip(tallies, stores, strict=True)
            )
        )
    finally:
        await other.close()
    assert first.count("admitted") == 3
    assert "admitted" not in second
    assert all(n >= 1 for n in written)
    rows = await db.fetch(
        "SELECT outcome, reason, sum(decisions)::int AS n FROM decision_counts"
        " WHERE tenant = 'acme' GROUP BY 1, 2 ORDER BY 1, 2"
    )
    assert [tuple(r) for r in rows] == [("admitted", "none", 3), ("refused", "tenant_tokens", 6)]
    # Drained: a second flush writes nothing more.
    assert await flush_decision_counts(tallies[0], stores[0]) == 0


async def test_a_flush_adds_to_the_minute_and_prunes_minutes_older_than_two_days(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    store = ConsoleStore(limiter.store.pool)
    old = datetime.now(UTC) - timedelta(seconds=KEEP_SECONDS + 120)
    await db.execute(
        "INSERT INTO decision_counts VALUES ($1, 'acme', 'admitted', 'none', 7)",
        minute_datetime(minute_of(old.timestamp())),
    )
    now = time.time()
    key = (minute_of(now), "acme", "refused", "concurrency")
    await store.add_decision_counts([(key, 2)], KEEP_SECONDS)
    await store.add_decision_counts([(key, 3)], KEEP_SECONDS)
    rows = await db.fetch("SELECT minute, outcome, decisions FROM decision_counts")
    assert [(r["minute"], r["outcome"], r["decisions"]) for r in rows] == [
        (minute_datetime(minute_of(now)), "refused", 5)
    ]
    since = minute_datetime(minute_of(now)) - timedelta(minutes=59)
    per_minute = await store.decisions_per_minute(since)
    assert [(c.outcome, c.reason, c.decisions) for c in per_minute] == [
        ("refused", "concurrency", 5)
    ]


async def test_a_process_that_runs_no_flush_loop_counts_nothing_in_memory(
    limiter: Limiter,
) -> None:
    await put(limiter, "tenant", "acme", tokens_per_minute=60, token_burst=1_000)
    await limiter.refresh_policies()
    assert await _decide(limiter, "acme", 300, 3) == ["admitted"] * 3
    assert limiter.metrics.tally is None
