"""Calendar quotas through admission itself, with the database clock moved.

PostgreSQL runs under libfaketime (tests/faketime_server.py): the test
rewrites a file and every `clock_timestamp()` of the server jumps, without a
restart and without sleeping. Admissions and settlements go through the real
REST app, whose decisions read time from the database clock alone. Each
scenario crosses one calendar boundary of a quota and proves, with the
figures the database ends up holding:

- usage before the local boundary counts in the old window, after it in the
  new one;
- a 429 names the local boundary as `resets_at`, and `retry_after_ms` runs
  until it: on the far side, the length of the whole new window (23 or 25
  hours on DST days, 28, 29 or 31 days for months);
- a reservation admitted before the boundary and settled after it is given
  back to the old window and charged to the new one;
- the window really ends at the next local boundary: full a minute before
  it, empty a minute after it (so a 23-hour day is not taken for 24 hours,
  nor a 25-hour day for 24).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import asyncpg
import httpx
import pytest

from llmquota.api.app import create_app
from llmquota.config import Settings
from llmquota.store import migrate
from tests.api.conftest import ADMIN_KEY, make_tenant
from tests.conftest import _admin, dsn_with_database
from tests.faketime_server import FaketimeServer, faketime_server

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
LIMIT_TOKENS = 1_000
MINUTE = timedelta(minutes=1)


@dataclass(frozen=True)
class Boundary:
    """A quota's calendar boundary: the windows on either side of `at` (local)."""

    zone: str
    period: str
    previous_start: str  # local wall times, "YYYY-MM-DD HH:MM"
    at: str
    next_end: str
    hours_before: int  # length of the window that ends at `at`
    hours_after: int  # length of the window that starts at `at`

    def instant(self, local: str) -> datetime:
        """The instant of a local wall time, in UTC (aware arithmetic across zones is exact)."""
        return datetime.fromisoformat(local).replace(tzinfo=ZoneInfo(self.zone)).astimezone(UTC)


BOUNDARIES = {
    # 2026-03-29: Berlin's clocks go 02:00 -> 03:00, a 23-hour day.
    "berlin-23h": Boundary(
        "Europe/Berlin", "day", "2026-03-28 00:00", "2026-03-29 00:00", "2026-03-30 00:00", 24, 23
    ),
    # 2026-10-25: 03:00 -> 02:00, a 25-hour day.
    "berlin-25h": Boundary(
        "Europe/Berlin", "day", "2026-10-24 00:00", "2026-10-25 00:00", "2026-10-26 00:00", 24, 25
    ),
    # America/New_York: 2026-03-08 (23 hours) and 2026-11-01 (25 hours).
    "new-york-23h": Boundary(
        "America/New_York",
        "day",
        "2026-03-07 00:00",
        "2026-03-08 00:00",
        "2026-03-09 00:00",
        24,
        23,
    ),
    "new-york-25h": Boundary(
        "America/New_York",
        "day",
        "2026-10-31 00:00",
        "2026-11-01 00:00",
        "2026-11-02 00:00",
        24,
        25,
    ),
    # America/Santiago changes at local midnight: on 2026-04-05 00:00 the
    # clocks go back to 04-04 23:00 (04-04 has 25 hours, its last hour twice),
    # and 2026-09-06 00:00 does not exist (the day starts at 01:00, 23 hours).
    "santiago-25h-at-midnight": Boundary(
        "America/Santiago",
        "day",
        "2026-04-03 00:00",
        "2026-04-04 00:00",
        "2026-04-05 00:00",
        24,
        25,
    ),
    "santiago-missing-midnight": Boundary(
        "America/Santiago",
        "day",
        "2026-09-05 00:00",
        "2026-09-06 00:00",
        "2026-09-07 00:00",
        24,
        23,
    ),
    # Months: January (31 days) into February (28, 2026 is no leap year) ...
    "jan-31-feb-1": Boundary(
        "Europe/Berlin",
        "month",
        "2026-01-01 00:00",
        "2026-02-01 00:00",
        "2026-03-01 00:00",
        31 * 24,
        28 * 24,
    ),
    # ... February into March (31 days, one of them Berlin's 23-hour DST day) ...
    "feb-28-mar-1": Boundary(
        "Europe/Berlin",
        "month",
        "2026-02-01 00:00",
        "2026-03-01 00:00",
        "2026-04-01 00:00",
        28 * 24,
        31 * 24 - 1,
    ),
    # ... and 2028's leap February (29 days) into March (New York: DST on 2028-03-12).
    "feb-29-2028": Boundary(
        "America/New_York",
        "month",
        "2028-02-01 00:00",
        "2028-03-01 00:00",
        "2028-04-01 00:00",
        29 * 24,
        31 * 24 - 1,
    ),
}


@pytest.fixture(scope="module")
def clock_server() -> Iterator[tuple[FaketimeServer, str]]:
    """A server under libfaketime and a migrated template database on it."""
    with faketime_server() as server:
        # Admission never reads a time earlier than a layer's last refill, so
        # every row of the template is made before the earliest scenario.
        server.set_clock(datetime(2025, 12, 1, tzinfo=UTC))
        template = "llmquota_clock_template"
        migrate.upgrade(_create(server.dsn, template))
        yield server, template


def _create(server_dsn: str, name: str, template: str | None = None) -> str:
    suffix = f' TEMPLATE "{template}"' if template else ""
    asyncio.run(_admin(server_dsn, f'CREATE DATABASE "{name}"{suffix}'))
    return dsn_with_database(server_dsn, name)


@pytest.fixture
async def database_dsn(clock_server: tuple[FaketimeServer, str]) -> AsyncIterator[str]:
    """The test's database, on the server whose clock the test moves.

    It overrides the session fixture, so the faults suite's autouse audit
    runs on this database after the test.
    """
    server, template = clock_server
    name = f"llmquota_clock_{time.time_ns()}"
    await _admin(server.dsn, f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    yield dsn_with_database(server.dsn, name)
    await _admin(server.dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
async def client(database_dsn: str) -> AsyncIterator[httpx.AsyncClient]:
    settings = Settings(  # type: ignore[call-arg]
        admin_key=ADMIN_KEY,
        pool_min_size=1,
        pool_max_size=4,
        decision_deadline_ms=60_000,
        _env_file=None,
    )
    app = create_app(settings, dsn=database_dsn)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://llmquota") as c:
            yield c


class Clock:
    """Moves the database clock and remembers when (monotonic), to bound its drift."""

    def __init__(self, server: FaketimeServer) -> None:
        self.server = server
        self.set_at = time.monotonic()

    def set(self, at: datetime) -> None:
        # Taken first: the database clock reads `at` from the moment set_clock
        # computes its offset, so this bounds the drift from above.
        self.set_at = time.monotonic()
        self.server.set_clock(at)

    def drift_ms(self) -> int:
        """How far the database clock can have run since it was set, in ms (rounded up)."""
        return int((time.monotonic() - self.set_at) * 1000) + 2


async def admit(
    client: httpx.AsyncClient, key: dict[str, str], input_tokens: int, max_tokens: int
) -> httpx.Response:
    body = {
        "tenant": "acme",
        "model": "gpt-4o",
        "input_tokens": input_tokens,
        "max_tokens": max_tokens,
        "lease_seconds": 3_600,
    }
    return await client.post("/v1/admit", json=body, headers=key)


async def settle(
    client: httpx.AsyncClient, key: dict[str, str], response: httpx.Response, used: int
) -> dict[str, Any]:
    rid = response.json()["reservation_id"]
    answer = await client.post(
        f"/v1/reservations/{rid}/settle",
        json={"input_tokens": 100, "output_tokens": used - 100},
        headers=key,
    )
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def assert_refused_until(
    response: httpx.Response, resets_at: datetime, window_ms_left: int, clock: Clock
) -> str:
    """A quota 429 whose resets_at is `resets_at` and whose wait runs until it; its text."""
    assert response.status_code == 429, response.text
    error = response.json()["error"]
    assert (error["type"], error["limit"], error["quota"]) == (
        "insufficient_quota",
        "quota",
        "daily-or-monthly",
    )
    said = datetime.fromisoformat(error["resets_at"])
    assert said.utcoffset() is not None and said == resets_at
    assert window_ms_left - clock.drift_ms() <= error["retry_after_ms"] <= window_ms_left
    assert int(response.headers["Retry-After"]) == -(-error["retry_after_ms"] // 1000)
    return str(error["resets_at"])


async def windows(db: asyncpg.Connection) -> list[tuple[datetime, datetime, int, int]]:
    rows = await db.fetch(
        "SELECT window_start, window_end, reserved_tokens, charged_tokens"
        " FROM quota_windows ORDER BY window_start"
    )
    return [tuple(r) for r in rows]  # type: ignore[misc]


@pytest.mark.parametrize("name", list(BOUNDARIES))
async def test_a_quota_window_boundary_crossed_by_real_admissions_on_a_moved_clock(
    name: str,
    clock_server: tuple[FaketimeServer, str],
    client: httpx.AsyncClient,
    db: asyncpg.Connection,
) -> None:
    b = BOUNDARIES[name]
    old_start, boundary, new_end = (
        b.instant(b.previous_start),
        b.instant(b.at),
        b.instant(b.next_end),
    )
    assert (boundary - old_start, new_end - boundary) == (
        timedelta(hours=b.hours_before),
        timedelta(hours=b.hours_after),
    )
    clock = Clock(clock_server[0])
    clock.set(boundary - 2 * MINUTE)  # forward from the template's time, never back
    key = await make_tenant(client, ADMIN, "acme", tokens_per_minute=10_000_000)
    put = await client.put(
        "/v1/tenants/acme/quotas/daily-or-monthly",
        json={"period": b.period, "timezone": b.zone, "tokens": LIMIT_TOKENS},
        headers=ADMIN,
    )
    assert put.status_code == 201, put.text

    # A minute before the local boundary: 600 held open, 300 held and settled at 200.
    clock.set(boundary - MINUTE)
    assert await db.fetchval("SELECT clock_timestamp() < $1", boundary)
    open_across = await admit(client, key, 100, 500)
    assert open_across.status_code == 201, open_across.text
    settled = await admit(client, key, 100, 200)
    assert (await settle(client, key, settled, 200))["late"] is False
    # 800 used of 1,000: 400 more is refused until the boundary, a minute away.
    said = assert_refused_until(await admit(client, key, 100, 300), boundary, 60_000, clock)

    # A minute after it: a new, empty window; the open reservation settles here.
    clock.set(boundary + MINUTE)
    assert (await settle(client, key, open_across, 250))["late"] is False
    filled = await admit(client, key, 100, 650)  # 250 + 750 = the whole 1,000
    assert filled.status_code == 201, filled.text
    await settle(client, key, filled, 750)  # charged in full: no lease to outlive
    whole_window_ms = (b.hours_after * 3600 - 60) * 1000
    assert_refused_until(await admit(client, key, 1, 1), new_end, whole_window_ms, clock)

    # The new window lasts exactly to the next local boundary, not 24 h (or
    # 30 days): still full a minute before it, empty a minute after it.
    clock.set(new_end - MINUTE)
    assert_refused_until(await admit(client, key, 1, 1), new_end, 60_000, clock)
    clock.set(new_end + MINUTE)
    assert (await admit(client, key, 1, 1)).status_code == 201

    assert await windows(db) == [
        # the old window: the 200 settled in it; the open reservation given back
        (old_start, boundary, 0, 200),
        # the new one: the open reservation's 250, settled in it, and 750
        (boundary, new_end, 0, 1_000),
        (
            new_end,
            await db.fetchval(
                "SELECT window_end FROM quota_windows WHERE window_start = $1", new_end
            ),
            2,
            0,
        ),
    ]
    ledger = await db.fetch(
        "SELECT recorded_at, input_tokens + output_tokens AS used FROM usage_ledger"
        " ORDER BY recorded_at"
    )
    assert [r["used"] for r in ledger] == [200, 250, 750]
    assert ledger[0]["recorded_at"] < boundary <= ledger[1]["recorded_at"]
    print(
        f"FIGURE quota-clock {name}: windows {b.hours_before} h | {b.hours_after} h, "
        f"boundary {boundary.isoformat()}, resets_at said {said}; "
        f"old window charged 200 reserved 0, new window charged 250 + 750 reserved 0"
    )
