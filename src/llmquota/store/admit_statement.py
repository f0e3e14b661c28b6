"""The admission statement: lq_admit for a batch, by a deadline on the database's clock.

A caller that stops waiting for an admission answers by the failure mode,
so the statement must not take effect after that: it carries the moment
its caller stops waiting, stated on the database's clock as last seen
(store/clock.py: every batch's answer reports that clock), and lq_admit
writes nothing when it starts or finishes past it. That refusal (SQLSTATE
LQ002) is a StoreTimeout here, as if the wait had run out on this side.
The statement also names the ids its admissions get, so that what a
statement nobody waited for did make can still be released
(admission/abandoned.py).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator, Sequence
from datetime import datetime

import asyncpg

from llmquota.domain.errors import StoreTimeout
from llmquota.domain.records import AdmitDecision, AdmitRequest
from llmquota.store.clock import DatabaseClock
from llmquota.store.deadline import MAX_LAG_CREDIT_SECONDS
from llmquota.store.decisions import DATABASE_NOW_COLUMN, admit_arguments, admit_decisions
from llmquota.store.pool import DeadlinePool

# lq_admit's refusal to write past the deadline it was given.
PAST_DEADLINE_SQLSTATE = "LQ002"


class AdmitStatement:
    """Runs lq_admit for batches and keeps the database's clock it reports."""

    def __init__(
        self,
        pool: DeadlinePool,
        sql: dict[str, str],
        concurrency_retry_ms: int,
        synchronous_commit: bool,
    ) -> None:
        self._pool = pool
        self._sql = sql
        self._concurrency_retry_ms = concurrency_retry_ms
        # Off: the commit does not wait for the WAL flush (admit_without_flush).
        self._synchronous_commit = synchronous_commit
        self.clock = DatabaseClock()

    async def admit(
        self,
        requests: Sequence[AdmitRequest],
        deadline_seconds: float | None,
        reservation_ids: Sequence[uuid.UUID] | None,
    ) -> list[AdmitDecision]:
        """Decide the batch in order; with `deadline_seconds`, nothing is written past it."""
        if deadline_seconds is not None and not self.clock.known():
            await self.read_clock(deadline_seconds)
        arguments = admit_arguments(requests, self._concurrency_retry_ms)
        sql = self._sql["admit"] if self._synchronous_commit else self._sql["admit_without_flush"]

        def bound() -> tuple[object, ...]:
            # Stated once a connection is held, right before sending: an
            # event-loop stall while waiting for the connection must not send
            # a deadline that already passed.
            # Plus the most the wait credits back for event-loop stalls
            # (store/deadline.py): until then this worker may still be waiting.
            # A statement that commits after it gave up is released by the
            # abandoned-ids journal (admission/abandoned.py).
            deadline = (
                None
                if deadline_seconds is None
                else self.clock.deadline(deadline_seconds + MAX_LAG_CREDIT_SECONDS)
            )
            # $1-$17, then the deadline ($18) and the ids ($19), then $20 onwards
            return (*arguments[:17], deadline, reservation_ids, *arguments[17:])

        try:
            with past_deadline_as_timeout(self.clock):
                rows = await self._pool.fetch(sql, bound, deadline_seconds=deadline_seconds)
        except PastDeadline:
            # Refused, and this worker still waits (past its own deadline the
            # caller has had the failure mode's answer and this task is
            # cancelled, so it never gets here): the statement reached the
            # database later than the deadline it was given, because this
            # worker's reading of the database's clock was behind (a clock
            # stepped forward; the refusal brought the new reading). Once
            # more, by a deadline stated then: it is still the caller's one
            # decision.
            if deadline_seconds is None:
                raise
            with past_deadline_as_timeout(self.clock):
                rows = await self._pool.fetch(sql, bound, deadline_seconds=deadline_seconds)
        if rows:
            self.clock.observe(rows[-1][DATABASE_NOW_COLUMN])
        return admit_decisions(rows)

    async def read_clock(self, deadline_seconds: float | None = None) -> None:
        """Take a reading of the database's clock."""
        sql = self._sql["database_clock"]
        rows = await self._pool.fetch(sql, (), deadline_seconds=deadline_seconds)
        self.clock.observe(rows[0]["database_now"])


@contextlib.contextmanager
def past_deadline_as_timeout(clock: DatabaseClock) -> Iterator[None]:
    """lq_admit refusing to write past its deadline, as the timeout it stands for.

    The refusal carries the database's clock (its DETAIL), which `clock`
    takes: had the database's clock been stepped forward, every deadline
    stated on the old reading would be refused, and no answer would ever
    bring the new one."""
    try:
        yield
    except asyncpg.PostgresError as exc:
        if exc.sqlstate == PAST_DEADLINE_SQLSTATE:
            detail = getattr(exc, "detail", None)
            with contextlib.suppress(TypeError, ValueError):
                clock.observe(datetime.fromisoformat(str(detail)))
            raise PastDeadline(f"database gave no decision in time ({exc})") from exc
        raise


class PastDeadline(StoreTimeout):
    """lq_admit wrote nothing: its statement was past the deadline it was given."""
