"""Releases of admissions nobody will hear of, run in the background.

An admission can be made for a caller that is gone by the time it is
decided: cancelled mid-batch (batching.Coalescer's orphans), or an HTTP
client that left its wait queue (waiting.py). Nobody holds its id, so nobody
can call the provider with it; without a release it would hold its tokens
and permit until the sweeper expired it. A replayed admission belongs to
whoever made it first and is left alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Awaitable, Callable

from llmquota.domain.errors import ReservationConflict, ReservationNotFound, StoreUnavailable
from llmquota.domain.records import AdmitDecision, AdmitRequest


class BackgroundReleases:
    """Release admitted decisions in background tasks; `close` awaits them."""

    def __init__(self, release: Callable[[uuid.UUID], Awaitable[None]]) -> None:
        self._release = release
        self._tasks: set[asyncio.Task[None]] = set()

    def release(self, decision: AdmitDecision) -> None:
        """Give an admission back (nothing for a refusal or a replay)."""
        if decision.status != "admitted" or decision.reservation_id is None:
            return
        reservation_id = decision.reservation_id

        async def release() -> None:
            # Already released, expired or unreachable: the sweeper has the last word.
            with contextlib.suppress(StoreUnavailable, ReservationNotFound, ReservationConflict):
                await self._release(reservation_id)

        task = asyncio.get_running_loop().create_task(release())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def orphan(self, request: AdmitRequest, decision: AdmitDecision) -> None:
        """The Coalescer's `on_orphan`: a caller cancelled while its batch was in flight."""
        self.release(decision)

    async def close(self) -> None:
        while self._tasks:
            await asyncio.wait(set(self._tasks))
