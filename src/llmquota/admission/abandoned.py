"""Admissions a worker stopped waiting for, to be released once the store answers.

When an admission statement outlives its deadline, the worker answers its
callers by the failure mode and the statement's fate is unknown: it may
never have arrived, it may start later (then lq_admit refuses to write, past
its deadline), or it may have committed while its answer was lost or
delayed (a server frozen after deciding, a network that dropped the reply).
The last case would leave reservations nobody holds, keeping tokens,
permits, credits and quota until their leases ran out. So every admission
statement names the reservation ids it may create (lq_admit's
p_reservation_ids), and a statement that timed out or lost its connection
leaves its ids here; the recovery task releases them when the store answers
again. Releasing an id that was never created finds nothing (not_found) and
costs nothing more; one already released, settled or expired is a conflict
and left alone.

An id found missing is looked for again (every RETRY_MISSING_SECONDS) until
its statement can no longer commit: `settle_seconds` (the server's
statement_timeout) after the first release found it missing, since a
statement still running on a server that has just woken up may commit a
moment after that first look, however long ago it was abandoned.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence

from llmquota.domain.records import FinishRequest, FinishResult

log = logging.getLogger(__name__)

# How often ids found missing are looked for again while they may still appear.
RETRY_MISSING_SECONDS = 1.0


class AbandonedAdmissions:
    """Reservation ids of admission statements nobody waits for any more."""

    def __init__(self, max_entries: int, settle_seconds: float) -> None:
        self.max_entries = max_entries
        # How long an id may still appear after a release first found it missing.
        self.settle_seconds = settle_seconds
        # reservation id -> when a release first found it missing (time.monotonic()),
        # None until then.
        self._ids: dict[uuid.UUID, float | None] = {}
        self.dropped = 0

    def abandon(self, reservation_ids: Sequence[uuid.UUID]) -> None:
        """A statement naming these ids timed out or lost its connection."""
        room = self.max_entries - len(self._ids)
        if room < len(reservation_ids):
            # Past the bound the sweeper has the last word: the leases run out.
            self.dropped += len(reservation_ids) - max(room, 0)
            log.warning(
                "abandoned admissions journal full (%d ids): %d ids left to lease expiry",
                self.max_entries,
                len(reservation_ids) - max(room, 0),
            )
        for reservation_id in reservation_ids[: max(room, 0)]:
            self._ids[reservation_id] = None

    def __len__(self) -> int:
        return len(self._ids)

    async def release(
        self,
        finish: Callable[[list[FinishRequest]], Awaitable[list[FinishResult]]],
        batch_size: int,
        now: float,
    ) -> int:
        """Release every id in batches of `finish` statements; how many were released.

        An id is forgotten once the store has decided it (released, or a
        conflict: someone else finished it), or when it was not found and
        its statement can no longer commit.
        """
        released = 0
        pending = list(self._ids.items())
        for start in range(0, len(pending), batch_size):
            chunk = pending[start : start + batch_size]
            results = await finish([FinishRequest(rid, "release", None) for rid, _ in chunk])
            for (reservation_id, missing_since), result in zip(chunk, results, strict=True):
                released += result.status == "released"
                if result.status != "not_found":
                    self._ids.pop(reservation_id, None)
                elif missing_since is None:
                    self._ids[reservation_id] = now
                elif now - missing_since >= self.settle_seconds:
                    self._ids.pop(reservation_id, None)
        return released
