"""Bounded lock waits for a step that is rolled back whole when it fails.

A migration's DDL takes strong table locks (ACCESS EXCLUSIVE for most of
it) while the service runs. PostgreSQL queues lock requests in order: one
that waits, for a long report's lock or a transaction left open, holds up
every later request on the same table, admissions' row locks included, for
as long as it waits. So each statement of a migration waits a bounded time
(lock_timeout), and a step whose wait ran out is rolled back and tried
again after a pause in which the service runs, as strong_migrations and
GitLab's `with_lock_retries` do for Rails.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

__all__ = [
    "DEFAULT_PATIENCE",
    "LockPatience",
    "MigrationLocksUnavailable",
    "patiently",
    "patiently_async",
]

_logger = logging.getLogger(__name__)

# What a statement that waited too long for a lock fails with: lock_timeout's
# lock_not_available, and deadlock_detected for the one a deadlock chose.
LOCK_WAIT_SQLSTATES = frozenset({"55P03", "40P01"})
# The longest pause between two tries.
MAX_PAUSE_SECONDS = 15.0

_T = TypeVar("_T")


@dataclass(frozen=True)
class LockPatience:
    """How long a migration waits for the locks of the tables it changes.

    Each statement waits `timeout_ms` at most (PostgreSQL's lock_timeout; 0:
    as long as it takes); one that waits longer fails its revision, which is
    rolled back and tried again after a pause of 1, 2, 4, 8, then 15 s, up to
    `attempts` tries in all. The default's 1 s is half the service's own
    lock_timeout (2 s): an admission queued behind the migration's lock
    request gets its lock before its own wait runs out.
    """

    timeout_ms: int = 1_000
    attempts: int = 10

    def __post_init__(self) -> None:
        if self.timeout_ms < 0 or self.attempts < 1:
            raise ValueError("timeout_ms must be 0 or more, attempts 1 or more")

    def pause_seconds(self, failed: int) -> float:
        """The pause after the `failed`-th try."""
        return min(2.0 ** (failed - 1), MAX_PAUSE_SECONDS)


# What `llmquota migrate` uses unless told otherwise (its settings).
DEFAULT_PATIENCE = LockPatience()


class MigrationLocksUnavailable(Exception):
    """A step's locks were not granted in any of its tries (LockPatience). The
    step was rolled back; the revisions before it stay applied."""


def _waited_too_long(error: BaseException) -> bool:
    """Whether `error` (or what it wraps: SQLAlchemy's, the driver's) is a lock
    wait that timed out or lost a deadlock."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if getattr(current, "sqlstate", None) in LOCK_WAIT_SQLSTATES:
            return True
        current = getattr(current, "orig", None) or current.__cause__ or current.__context__
    return False


def _pause_after(patience: LockPatience, step: str, attempt: int, error: Exception) -> float:
    """The pause before trying `step` again after its `attempt`-th try failed
    with `error`; raises when `error` is not a lock wait, or no try is left."""
    if not _waited_too_long(error):
        raise error
    if attempt >= patience.attempts:
        tries = "its one try" if patience.attempts == 1 else f"any of {patience.attempts} tries"
        raise MigrationLocksUnavailable(
            f"{step}: a lock it needs was not granted within {patience.timeout_ms} ms "
            f"in {tries}; it was rolled back. A session holds "
            "a table it changes (a long transaction or report: see pg_stat_activity); "
            "run migrate again once it ends"
        ) from error
    pause = patience.pause_seconds(attempt)
    _logger.warning(
        "%s: a lock was not granted within %d ms (try %d of %d); rolled back, trying again in %g s",
        step,
        patience.timeout_ms,
        attempt,
        patience.attempts,
        pause,
    )
    return pause


def patiently(patience: LockPatience, step: str, run: Callable[[], _T]) -> _T:
    """`run` (a step rolled back whole when it fails), tried again after a
    pause while its lock waits time out. Blocks: call it off any event loop."""
    attempt = 1
    while True:
        try:
            return run()
        except Exception as error:
            time.sleep(_pause_after(patience, step, attempt, error))
        attempt += 1


async def patiently_async(
    patience: LockPatience, step: str, run: Callable[[], Awaitable[_T]]
) -> _T:
    """patiently for a coroutine's step."""
    attempt = 1
    while True:
        try:
            return await run()
        except Exception as error:
            await asyncio.sleep(_pause_after(patience, step, attempt, error))
        attempt += 1
