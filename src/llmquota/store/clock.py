"""The database's clock as this worker last saw it, to state deadlines on.

An admission statement carries the moment its worker stops waiting for it
(lq_admit's p_deadline), and the database compares it with its own clock,
so the two clocks never have to agree: the worker keeps the offset between
the database's clock and its own monotonic one, learnt from the clock the
database reports (every admission batch reports it, store.py).

A reading is taken on the database before its answer travels back, so
`database time - local time of arrival` is never more than the true offset:
the deadline computed from it is never later than the worker's real one,
only earlier by how long that answer took to be read. The estimate is the
largest such offset seen in the last two windows of WINDOW_SECONDS (the
reading that travelled fastest), so a clock the database steps back is
followed within two windows, and one it steps forward at once.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

WINDOW_SECONDS = 30.0


class DatabaseClock:
    """The offset from this process's monotonic clock to the database's."""

    __slots__ = ("_best", "_previous", "_window_started")

    def __init__(self) -> None:
        self._best: float | None = None
        self._previous: float | None = None
        self._window_started = 0.0

    def observe(self, database_now: datetime, local_now: float | None = None) -> None:
        """The database said it was `database_now` in an answer read at `local_now`
        (this process's time.monotonic(); now when omitted)."""
        local = time.monotonic() if local_now is None else local_now
        offset = database_now.timestamp() - local
        if local - self._window_started >= WINDOW_SECONDS:
            self._previous, self._best = self._best, None
            self._window_started = local
        if self._best is None or offset > self._best:
            self._best = offset

    def known(self) -> bool:
        """Whether a reading was taken yet."""
        return self._best is not None

    def deadline(self, seconds: float, local_now: float | None = None) -> datetime | None:
        """`seconds` from now on the database's clock, as last seen; None before any reading."""
        offsets = [o for o in (self._best, self._previous) if o is not None]
        if not offsets:
            return None
        local = time.monotonic() if local_now is None else local_now
        return datetime.fromtimestamp(local + max(offsets), UTC) + timedelta(seconds=seconds)
