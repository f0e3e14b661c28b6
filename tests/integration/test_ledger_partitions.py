"""Monthly ledger partitions: rows land in their month, a boundary crossed
while settling loses nothing, the sweeper keeps months ready, old months
detach for archival.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import datetime, timedelta

import asyncpg
import pytest

from llmquota.admission.limiter import Limiter
from llmquota.config import Settings

# The statement lq_finish uses to append a row, with recorded_at given, so a
# test can stand on either side of a month boundary.
INSERT_AT = """
INSERT INTO usage_ledger (reservation_id, entry_kind, tenant, route, model, input_tokens,
                          output_tokens, reserved_tokens, outcome, policy_version, recorded_at)
VALUES ($1, 'usage', 'acme', 'chat', 'gpt-4o', 1, 2, 3, 'ok', 1, $2)
RETURNING tableoid::regclass::text
"""

BOUNDARY_RUN_MARGIN = timedelta(seconds=1.5)
WORKERS = 6


async def _month_start(db: asyncpg.Connection, months_from_now: int) -> datetime:
    value: datetime = await db.fetchval(
        "SELECT (date_trunc('month', now() AT TIME ZONE 'UTC')"
        " + make_interval(months => $1))::timestamp AT TIME ZONE 'UTC'",
        months_from_now,
    )
    return value


async def _partitions(db: asyncpg.Connection) -> list[str]:
    rows = await db.fetch(
        "SELECT c.relname FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid"
        " WHERE i.inhparent = 'usage_ledger'::regclass ORDER BY c.relname"
    )
    return [r["relname"] for r in rows]


def _name(month: datetime) -> str:
    return f"usage_ledger_{month:%Y_%m}"


async def test_rows_on_each_side_of_a_month_boundary_land_in_their_month(
    db: asyncpg.Connection,
) -> None:
    boundary = await _month_start(db, 1)
    far = await _month_start(db, 40)  # no partition this far ahead
    landed = {
        label: await db.fetchval(INSERT_AT, uuid.uuid4(), at)
        for label, at in {
            "before": boundary - timedelta(microseconds=1),
            "at": boundary,
            "after": boundary + timedelta(microseconds=1),
            "far": far,
        }.items()
    }
    this_month, next_month = _name(await _month_start(db, 0)), _name(boundary)
    assert landed == {
        "before": this_month,
        "at": next_month,
        "after": next_month,
        "far": "usage_ledger_default",
    }
    assert await db.fetchval("SELECT count(*) FROM usage_ledger") == 4


async def test_a_boundary_crossed_while_settling_loses_no_row(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    # A boundary a moment from now, by the database clock: this month's
    # partition is split in two there, and real settlements (stamped by
    # lq_finish with the database clock) run across it.
    month_start, month_end = await _month_start(db, 0), await _month_start(db, 1)
    boundary: datetime = await db.fetchval("SELECT now()") + BOUNDARY_RUN_MARGIN
    assert boundary + BOUNDARY_RUN_MARGIN < month_end, "run within seconds of a real month end"
    this_month = _name(month_start)
    await db.execute(f"ALTER TABLE usage_ledger DETACH PARTITION {this_month}")
    await db.execute(f"DROP TABLE {this_month}")
    for name, low, high in (
        ("usage_ledger_before", month_start, boundary),
        ("usage_ledger_after", boundary, month_end),
    ):
        await db.execute(
            f"CREATE TABLE {name} (LIKE usage_ledger INCLUDING DEFAULTS INCLUDING CONSTRAINTS)"
        )
        await db.execute(
            f"ALTER TABLE usage_ledger ATTACH PARTITION {name}"
            f" FOR VALUES FROM ('{low.isoformat()}') TO ('{high.isoformat()}')"
        )
    await limiter.store.ensure_tenant("acme")

    # The server's clock is this machine's: run until well past the boundary.
    deadline = time.monotonic() + 2 * BOUNDARY_RUN_MARGIN.total_seconds()

    async def worker() -> int:
        settled = 0
        while time.monotonic() < deadline:
            reservation = await limiter.admit(
                tenant="acme", model="gpt-4o", input_tokens=3, max_tokens=10
            )
            await reservation.settle(input_tokens=3, output_tokens=4)
            settled += 1
        return settled

    settled = sum(await asyncio.gather(*(worker() for _ in range(WORKERS))))

    placement = await db.fetch(
        "SELECT tableoid::regclass::text AS part, recorded_at >= $1 AS after, count(*)"
        " FROM usage_ledger GROUP BY 1, 2 ORDER BY 1",
        boundary,
    )
    counts = {(r["part"], r["after"]): r["count"] for r in placement}
    assert set(counts) == {("usage_ledger_after", True), ("usage_ledger_before", False)}
    assert sum(counts.values()) == settled > 0
    assert await db.fetchval("SELECT count(*) FROM reservations WHERE state = 'settled'") == (
        settled
    )
    assert await db.fetchval("SELECT sum(input_tokens + output_tokens) FROM usage_ledger") == (
        7 * settled
    )


async def test_the_sweeper_keeps_the_months_ahead_ready(
    app_dsn: str, db: asyncpg.Connection
) -> None:
    months = [await _month_start(db, i) for i in range(6)]
    assert await _partitions(db) == [_name(m) for m in months[:4]] + ["usage_ledger_default"]

    # An empty month ahead goes missing; the next sweeper run puts it back,
    # and with more months configured, creates those too.
    await db.execute(f"ALTER TABLE usage_ledger DETACH PARTITION {_name(months[3])}")
    await db.execute(f"DROP TABLE {_name(months[3])}")
    settings = Settings(ledger_months_ahead=5, _env_file=None)  # type: ignore[call-arg]
    sweeper = await Limiter.connect(app_dsn, settings)
    try:
        report = await sweeper.sweep()
        assert report.partitions_created == 3
        assert (await sweeper.sweep()).partitions_created == 0
    finally:
        await sweeper.close()
    assert await _partitions(db) == [_name(m) for m in months] + ["usage_ledger_default"]
    bounds = await db.fetchval(
        "SELECT pg_get_expr(relpartbound, oid) FROM pg_class WHERE relname = $1", _name(months[5])
    )
    assert bounds == (
        f"FOR VALUES FROM ('{months[5]:%Y-%m-%d} 00:00:00+00') "
        f"TO ('{months[5] + timedelta(days=40):%Y-%m}-01 00:00:00+00')"
    )


async def test_a_month_without_a_partition_falls_to_default_and_is_never_attached_live(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    this_month = await _month_start(db, 0)
    await db.execute(f"ALTER TABLE usage_ledger DETACH PARTITION {_name(this_month)}")
    await db.execute(f"DROP TABLE {_name(this_month)}")

    await limiter.store.ensure_tenant("acme")
    reservation = await limiter.admit(tenant="acme", model="gpt-4o", input_tokens=1, max_tokens=9)
    await reservation.settle(input_tokens=1, output_tokens=2)
    assert await db.fetchval("SELECT tableoid::regclass::text FROM usage_ledger") == (
        "usage_ledger_default"
    )

    # The sweeper never attaches the month rows are arriving in (a row routed
    # to DEFAULT meanwhile would fail), and a month whose rows are already in
    # DEFAULT stays there.
    last_month = await _month_start(db, -1)
    statuses = await db.fetch("SELECT * FROM lq_ensure_ledger_partitions(1, $1)", last_month)
    assert [tuple(r) for r in statuses] == [(_name(this_month), "too_close")]
    assert await db.fetchval("SELECT lq_create_ledger_partition($1::date)", this_month) == (
        "default_holds_rows"
    )
    assert _name(this_month) not in await _partitions(db)
    assert await db.fetchval("SELECT count(*) FROM usage_ledger") == 1


async def test_a_past_month_detaches_for_archival_once_exported(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    at = await _month_start(db, -14)
    old_month = at.date()
    assert await db.fetchval("SELECT lq_create_ledger_partition($1)", old_month) == "created"
    part = _name(at)
    for day in range(3):
        await db.fetchval(INSERT_AT, uuid.uuid4(), at + timedelta(days=day))

    with pytest.raises(asyncpg.ObjectNotInPrerequisiteStateError, match="has 3 rows"):
        await db.fetchval("SELECT lq_detach_ledger_partition($1)", old_month)
    with pytest.raises(asyncpg.InvalidParameterValueError, match="not in the past"):
        await db.fetchval("SELECT lq_detach_ledger_partition(current_date)")

    assert len(await db.fetch("SELECT * FROM lq_export_ledger(0, 100, 100)")) == 3
    assert await db.fetchval("SELECT lq_detach_ledger_partition($1)", old_month) == part
    # The rows leave the ledger and stay in the archived table.
    assert await db.fetchval("SELECT count(*) FROM usage_ledger") == 0
    assert await db.fetchval(f"SELECT count(*) FROM {part}") == 3
    # Admission carries on as before.
    await limiter.store.ensure_tenant("acme")
    reservation = await limiter.admit(tenant="acme", model="gpt-4o", input_tokens=1, max_tokens=9)
    await reservation.settle(input_tokens=1, output_tokens=1)
    assert await db.fetchval("SELECT count(*) FROM usage_ledger") == 1
