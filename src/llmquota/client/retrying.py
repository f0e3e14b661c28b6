"""When the client tries a call again, and after how long: one policy for sync and async.

Three kinds of failure, three rules:

- A 429 with a retry hint is waited out when the whole call, hint
  included, stays within the caller's `max_wait_ms` (0 by default: the
  RateLimited is raised at once, as the library does). A hint that would
  end past it is not waited for in vain: the refusal is raised at once.
- A 503 (the limiter's database did not answer, or the worker's queue is
  full) and a transport failure (refused connection, reset, timeout) are
  tried again at most `max_retries` times, with exponential backoff and
  jitter, and never sooner than a 503's Retry-After. An admission is safe to
  repeat because it always carries an idempotency key (wire.admit_body): the
  server replays the first admission instead of making a second. Settle and
  release are idempotent on the server, and a heartbeat only extends.
- Anything else is the answer: 401, 402, 403, 404, 409, 413 and 422 are
  never retried (the same request would get the same answer).

Pure: the clock is a parameter and the caller sleeps, so the sync and the
async client share every decision and differ only in how they wait.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from llmquota.client.wire import Answer
from llmquota.domain.errors import InvalidRequest

DEFAULT_MAX_RETRIES = 3
# Per attempt (connect, read, write, pool), as httpx counts it.
DEFAULT_TIMEOUT_SECONDS = 10.0
# Past this many attempts a failing server is not helped by a client that insists.
MAX_RETRIES_CAP = 10
# The first backoff, doubled per retry up to the last (before jitter).
BACKOFF_FIRST_SECONDS = 0.05
BACKOFF_MAX_SECONDS = 2.0
# A 503's Retry-After is honoured up to this (llmquota sends 1 s).
MAX_UNAVAILABLE_WAIT_SECONDS = 5.0
# The shortest wait for room: a 1 ms hint must not turn into a busy loop,
# so a call of max_wait_ms makes at most max_wait_ms / 10 attempts.
MIN_RATE_LIMIT_WAIT_MS = 10

RATE_LIMITED = 429
UNAVAILABLE = 503


def check_max_retries(max_retries: int) -> int:
    if isinstance(max_retries, bool) or not isinstance(max_retries, int):
        raise InvalidRequest("max_retries must be an integer")
    if not 0 <= max_retries <= MAX_RETRIES_CAP:
        raise InvalidRequest(f"max_retries must be between 0 and {MAX_RETRIES_CAP}")
    return max_retries


@dataclass
class Retrying:
    """The retry state of one call (an admission with its waits, or one settle)."""

    max_wait_ms: int
    max_retries: int
    clock: Callable[[], float]
    started: float = field(init=False)
    # 503s and transport failures so far.
    failures: int = field(default=0, init=False)
    # Seconds slept waiting out 429s (what the caller's max_wait_ms bought).
    waited_seconds: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        self.started = self.clock()

    def after_refusal(self, answer: Answer) -> float | None:
        """Seconds to wait before the next attempt; None: the answer stands."""
        if answer.status == RATE_LIMITED:
            return self._room_wait(answer.retry_after_ms())
        if answer.status == UNAVAILABLE and self.failures < self.max_retries:
            self.failures += 1
            hint_ms = answer.retry_after_ms() or 0
            return max(self._backoff(), min(hint_ms / 1000, MAX_UNAVAILABLE_WAIT_SECONDS))
        return None

    def after_failure(self) -> float | None:
        """Seconds to wait after a transport failure; None: out of retries."""
        if self.failures >= self.max_retries:
            return None
        self.failures += 1
        return self._backoff()

    def _room_wait(self, hint_ms: int | None) -> float | None:
        if hint_ms is None:
            return None
        wait_ms = max(hint_ms, MIN_RATE_LIMIT_WAIT_MS)
        elapsed_ms = (self.clock() - self.started) * 1000
        if elapsed_ms + wait_ms > self.max_wait_ms:
            return None  # room comes too late for this caller: the refusal stands
        self.waited_seconds += wait_ms / 1000
        return wait_ms / 1000

    def _backoff(self) -> float:
        """Exponential, with jitter over its upper half so retrying clients spread out."""
        ceiling = min(BACKOFF_FIRST_SECONDS * 2 ** (self.failures - 1), BACKOFF_MAX_SECONDS)
        return random.uniform(ceiling / 2, ceiling)
