"""When each key was last used, without a write per request.

A worker notes a key's use at most once a minute (NOTE_INTERVAL_SECONDS):
the first use after that starts one background statement (api_key_uses, a
table apart from api_keys so that it announces nothing and locks nothing a
revocation needs), and the request does not wait for it. So `last_used_at`
is at most a minute behind per worker, and a key used on N workers costs at
most N writes a minute. A failed note is logged and retried a minute later.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

# Note a key's use at most this often per worker.
NOTE_INTERVAL_SECONDS = 60.0
# Keys remembered; past this the map is cleared (the next uses note again).
MAX_KEYS = 10_000

# Store that key `key_id` was used now: AdminService.keys.note_use in the app.
KeyUse = Callable[[int], Awaitable[None]]


class UseNotes:
    """Per key id, when this worker last noted a use; the notes still running."""

    def __init__(self, note: KeyUse | None, interval_seconds: float = NOTE_INTERVAL_SECONDS):
        self._note = note
        self._interval = interval_seconds
        self._noted_at: dict[int, float] = {}
        self.tasks: set[asyncio.Task[None]] = set()

    def used(self, key_id: int, now: float) -> None:
        """A request authenticated with the key at `now` (monotonic)."""
        if self._note is None:
            return
        last = self._noted_at.get(key_id)
        if last is not None and now - last < self._interval:
            return
        if len(self._noted_at) >= MAX_KEYS:
            self._noted_at.clear()
        self._noted_at[key_id] = now
        task = asyncio.ensure_future(self._noted(key_id))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _noted(self, key_id: int) -> None:
        assert self._note is not None
        try:
            await self._note(key_id)
        except Exception:
            log.warning("noting the use of API key %s failed", key_id, exc_info=True)
