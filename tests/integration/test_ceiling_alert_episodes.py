"""The episode state machine of ceiling alerts, on real PostgreSQL, with explicit sample times.

record_ceiling_samples (sql/alerts_queries.sql) applied to samples whose
database-clock times the test chooses: an episode opens once, stays open
through dips shorter than the quiet time or shallower than the hysteresis,
ends after the quiet time below threshold - hysteresis, and a sample older
than the last one applied changes nothing. Many connections recording the
same crossing at once write one alert.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import asyncpg
import pytest

from llmquota.admission.limiter import Limiter
from llmquota.domain.ceiling_alerts import CeilingSample
from llmquota.store.alerts import AlertStore
from llmquota.store.store import Store
from tests.integration.support import count

# Also run on CI's Citus leg, in public and inside a cell (the detector's
# guarded upsert fires its alerts from one statement there too).
pytestmark = pytest.mark.citus

T0 = datetime(2026, 12, 3, 10, 0, tzinfo=UTC)


def sample(seconds: float, utilization: float, **fields: object) -> CeilingSample:
    made = CeilingSample(
        ceiling="org",
        dimension="tokens",
        threshold=Decimal("0.8"),
        utilization=utilization,
        level=1_000 * (1 - utilization),
        capacity=1_000,
        hysteresis=0.05,
        quiet_seconds=10.0,
        sampled_at=T0 + timedelta(seconds=seconds),
    )
    return dataclasses.replace(made, **fields)  # type: ignore[arg-type]


@pytest.fixture
def alerts(limiter: Limiter) -> AlertStore:
    return AlertStore(limiter.store.pool)


async def opened(alerts: AlertStore, *samples: CeilingSample) -> list[float]:
    """Record the samples; the seconds (after T0) of the episodes they opened."""
    found = await alerts.record_ceiling_samples(list(samples))
    return [(s.sampled_at - T0).total_seconds() for s, _ in found]


async def test_an_episode_opens_once_and_ends_only_after_the_quiet_time_below_the_hysteresis(
    alerts: AlertStore, db: asyncpg.Connection
) -> None:
    assert await opened(alerts, sample(0, 0.5)) == []
    assert await opened(alerts, sample(1, 0.8)) == [1]  # at the threshold: crossed
    assert await opened(alerts, sample(2, 0.99)) == []
    assert await opened(alerts, sample(3, 0.76)) == []  # a shallow dip
    assert await opened(alerts, sample(30, 0.76)) == []  # however long
    assert await opened(alerts, sample(31, 0.9)) == []
    assert await opened(alerts, sample(32, 0.7)) == []  # deep, for 9 s only
    assert await opened(alerts, sample(41, 0.7)) == []
    assert await opened(alerts, sample(42, 0.85)) == []  # the run ends: back above
    assert await opened(alerts, sample(43, 0.7)) == []  # a new run
    assert await opened(alerts, sample(52, 0.74)) == []  # still below 0.75
    assert await opened(alerts, sample(53, 0.6)) == []  # 10 s below: the episode ends
    state = await db.fetchrow("SELECT * FROM ceiling_alert_episodes")
    assert state is not None
    assert state["episode_start"] is None
    assert state["last_ended_at"] == T0 + timedelta(seconds=53)
    assert await opened(alerts, sample(54, 0.79)) == []
    assert await opened(alerts, sample(55, 0.81)) == [55]  # a new episode
    rows = await db.fetch(
        "SELECT window_start, threshold, usage, limit_value, payload FROM alert_outbox"
        " ORDER BY window_start"
    )
    assert [r["window_start"] for r in rows] == [T0 + timedelta(seconds=s) for s in (1, 55)]
    assert [(r["usage"], r["limit_value"]) for r in rows] == [(800, 1_000), (810, 1_000)]


async def test_a_sample_older_than_the_last_applied_changes_nothing(
    alerts: AlertStore, db: asyncpg.Connection
) -> None:
    assert await opened(alerts, sample(10, 0.9)) == [10]
    # A worker that read before, writing after: its older view is ignored,
    # whether it would end the episode or open it again.
    assert await opened(alerts, sample(5, 0.0, quiet_seconds=0.0)) == []
    assert await opened(alerts, sample(9, 0.9)) == []
    state = await db.fetchrow("SELECT episode_start, sampled_at FROM ceiling_alert_episodes")
    assert state is not None
    assert (state["episode_start"], state["sampled_at"]) == (T0 + timedelta(seconds=10),) * 2
    # The same sample twice: once.
    assert await opened(alerts, sample(11, 0.0, quiet_seconds=0.0)) == []
    assert await opened(alerts, sample(12, 0.9)) == [12]
    assert await opened(alerts, sample(12, 0.9)) == []
    assert await count(db, "alert_outbox") == 2


async def test_an_idle_bucket_ends_an_episode_whatever_the_hysteresis(
    alerts: AlertStore,
) -> None:
    low = {"threshold": Decimal("0.05"), "hysteresis": 0.1, "quiet_seconds": 0.0}
    assert await opened(alerts, sample(0, 0.06, **low)) == [0]
    assert await opened(alerts, sample(1, 0.01, **low)) == []  # not below -0.05: open
    assert await opened(alerts, sample(2, 0.06, **low)) == []
    assert await opened(alerts, sample(3, 0.0, **low)) == []  # idle: ends at once (no quiet)
    assert await opened(alerts, sample(4, 0.06, **low)) == [4]


async def test_thresholds_and_dimensions_are_episodes_of_their_own_and_pruning_forgets_the_gone(
    alerts: AlertStore, db: asyncpg.Connection
) -> None:
    both = [
        sample(1, 0.9, dimension="requests"),
        sample(1, 0.9, dimension="requests", threshold=Decimal("0.95")),
        sample(1, 0.9),
    ]
    assert await opened(alerts, *both) == [1, 1]
    subjects = await db.fetch("SELECT subject, threshold FROM alert_outbox ORDER BY 1, 2")
    assert [(r["subject"], str(r["threshold"])) for r in subjects] == [
        ("ceiling:org:requests", "0.8"),
        ("ceiling:org:tokens", "0.8"),
    ]
    # The 0.95 threshold is gone from a newer read: its state goes, the others stay.
    kept = [sample(2, 0.9, dimension="requests"), sample(2, 0.9)]
    await opened(alerts, *kept)
    assert await alerts.prune_ceiling_alert_states(kept, T0 + timedelta(seconds=2)) == 1
    # An older read names nothing: it removes nothing newer than itself.
    assert await alerts.prune_ceiling_alert_states([], T0 + timedelta(seconds=1)) == 0
    assert await count(db, "ceiling_alert_episodes") == 2


@pytest.fixture
async def stores(app_dsn: str) -> AsyncIterator[list[AlertStore]]:
    made = [await Store.connect(app_dsn, min_size=1, max_size=1) for _ in range(8)]
    yield [AlertStore(store.pool) for store in made]
    for store in made:
        await store.close()


async def test_eight_connections_recording_the_same_crossing_write_one_alert(
    stores: list[AlertStore], db: asyncpg.Connection
) -> None:
    await db.execute(
        "INSERT INTO webhooks (name, url, secret) VALUES ('ops', 'http://a/', $1)", "s" * 16
    )
    for round_ in range(5):  # each round: every connection with a sample of its own moment
        found = await asyncio.gather(
            *(
                store.record_ceiling_samples(
                    [
                        sample(
                            round_ * 10 + n * 0.001,
                            0.9 if round_ % 2 == 0 else 0.0,
                            quiet_seconds=0.0,
                        )
                    ]
                )
                for n, store in enumerate(stores)
            )
        )
        assert sum(len(f) for f in found) == (1 if round_ % 2 == 0 else 0)
    assert await count(db, "alert_outbox") == 3  # rounds 0, 2 and 4: three episodes
    assert await count(db, "alert_deliveries") == 3
