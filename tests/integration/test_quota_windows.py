"""Calendar windows of quotas (lq_quota_window), computed by PostgreSQL.

Every moment is passed explicitly: DST days and month ends are tested at
their instants, without moving a clock or sleeping for a day.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import asyncpg
import pytest


async def window(
    db: asyncpg.Connection, period: str, zone: str, at: str
) -> tuple[datetime, datetime]:
    row = await db.fetchrow(
        "SELECT window_start, window_end FROM lq_quota_window($1, $2, $3::text::timestamptz)",
        period,
        zone,
        at,
    )
    assert row is not None
    return row["window_start"], row["window_end"]


def utc(text: str) -> datetime:
    return datetime.fromisoformat(text).astimezone(UTC)


@pytest.mark.parametrize(
    ("zone", "at", "start", "hours"),
    [
        # Europe/Berlin: clocks go 02:00 -> 03:00 on 2026-03-29 (a 23-hour day) ...
        ("Europe/Berlin", "2026-03-29 12:00+02", "2026-03-29 00:00+01", 23),
        # ... and 03:00 -> 02:00 on 2026-10-25 (a 25-hour day).
        ("Europe/Berlin", "2026-10-25 12:00+01", "2026-10-25 00:00+02", 25),
        ("Europe/Berlin", "2026-10-26 00:00+01", "2026-10-26 00:00+01", 24),
        # America/New_York: 2026-03-08 is 23 hours, 2026-11-01 is 25.
        ("America/New_York", "2026-03-08 01:59-05", "2026-03-08 00:00-05", 23),
        ("America/New_York", "2026-03-08 23:59-04", "2026-03-08 00:00-05", 23),
        ("America/New_York", "2026-11-01 01:30-05", "2026-11-01 00:00-04", 25),
        ("UTC", "2026-11-01 01:30+00", "2026-11-01 00:00+00", 24),
    ],
)
async def test_a_day_is_midnight_to_midnight_local_time_with_dst_days_of_23_and_25_hours(
    db: asyncpg.Connection, zone: str, at: str, start: str, hours: int
) -> None:
    window_start, window_end = await window(db, "day", zone, at)
    assert window_start == utc(start)
    assert window_end - window_start == timedelta(hours=hours)
    assert window_start <= utc(at) < window_end


@pytest.mark.parametrize(
    ("zone", "at", "start", "end"),
    [
        ("UTC", "2026-02-28 23:59:59.999999+00", "2026-02-01 00:00+00", "2026-03-01 00:00+00"),
        ("UTC", "2028-02-29 12:00+00", "2028-02-01 00:00+00", "2028-03-01 00:00+00"),
        ("UTC", "2026-01-31 23:00+00", "2026-01-01 00:00+00", "2026-02-01 00:00+00"),
        ("UTC", "2026-04-30 23:00+00", "2026-04-01 00:00+00", "2026-05-01 00:00+00"),
        ("UTC", "2026-12-31 23:59+00", "2026-12-01 00:00+00", "2027-01-01 00:00+00"),
        # 23:30 UTC on Jan 31 is already February in Berlin.
        ("Europe/Berlin", "2026-01-31 23:30+00", "2026-02-01 00:00+01", "2026-03-01 00:00+01"),
        # March in Berlin spans the DST change: 31 days less one hour.
        ("Europe/Berlin", "2026-03-15 12:00+01", "2026-03-01 00:00+01", "2026-04-01 00:00+02"),
        ("America/New_York", "2026-11-30 23:00-05", "2026-11-01 00:00-04", "2026-12-01 00:00-05"),
    ],
)
async def test_a_month_is_the_calendar_month_of_28_to_31_days(
    db: asyncpg.Connection, zone: str, at: str, start: str, end: str
) -> None:
    assert await window(db, "month", zone, at) == (utc(start), utc(end))


async def test_the_boundary_instant_belongs_to_the_next_window(db: asyncpg.Connection) -> None:
    first = await window(db, "day", "Europe/Berlin", "2026-10-25 23:59:59.999999+01")
    second = await window(db, "day", "Europe/Berlin", "2026-10-26 00:00:00+01")
    assert first[1] == second[0]
    assert second[0] == utc("2026-10-26 00:00+01")


async def test_periods_other_than_day_and_month_and_unknown_zones_are_refused(
    db: asyncpg.Connection,
) -> None:
    with pytest.raises(asyncpg.InvalidParameterValueError, match="day or month"):
        await window(db, "week", "UTC", "2026-01-01 00:00+00")
    with pytest.raises(asyncpg.InvalidParameterValueError, match="time zone"):
        await window(db, "day", "Mars/Olympus_Mons", "2026-01-01 00:00+00")
