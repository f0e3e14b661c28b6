"""The database's clock as last seen: deadlines never later than the worker's own."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from llmquota.store.clock import WINDOW_SECONDS, DatabaseClock

# The database's clock runs this far ahead of the worker's monotonic one.
TRUE_OFFSET = 1_800_000_000.0


def database_time(local: float) -> datetime:
    return datetime.fromtimestamp(local + TRUE_OFFSET, UTC)


def test_no_deadline_before_the_first_reading() -> None:
    clock = DatabaseClock()
    assert not clock.known()
    assert clock.deadline(0.25, local_now=10.0) is None


def test_the_fastest_reading_gives_the_deadline_and_it_is_never_late() -> None:
    clock = DatabaseClock()
    # Read at 100.0 on the database, arriving 30 ms, 5 ms and 80 ms later here.
    clock.observe(database_time(100.0), local_now=100.030)
    clock.observe(database_time(101.0), local_now=101.005)
    clock.observe(database_time(102.0), local_now=102.080)
    deadline = clock.deadline(0.25, local_now=110.0)
    assert deadline is not None
    truth = database_time(110.0) + timedelta(seconds=0.25)
    # Early by the fastest answer's travel, 5 ms (to float rounding), never late.
    assert abs((truth - deadline).total_seconds() - 0.005) < 1e-5


def test_a_clock_stepped_back_is_followed_within_two_windows() -> None:
    clock = DatabaseClock()
    clock.observe(database_time(0.0), local_now=0.0)
    # The database's clock steps back 10 s.
    for t in range(1, int(3 * WINDOW_SECONDS)):
        clock.observe(database_time(t) - timedelta(seconds=10), local_now=float(t))
    local = 3 * WINDOW_SECONDS
    deadline = clock.deadline(0.0, local_now=local)
    assert deadline is not None
    stepped = database_time(local) - timedelta(seconds=10)
    assert abs((deadline - stepped).total_seconds()) < 1e-5
