"""A worker's memory of API keys: those that exist, refreshed while in use, and those that do not.

Authentication must not need the database on every request, nor at all
while the database is away: a request nobody can authenticate never reaches
its failure mode, so an outage would turn `open` and `local` into `closed`.
So a key found once is remembered, and a use of it past `refresh_seconds`
claims a background lookup while the remembered answer keeps serving. A key
in use thus stays fresh, a key deleted from the database is forgotten at its
next refresh, and during an outage (the refresh fails) a known key keeps
working for `max_stale_seconds`, the window the policy cache decides by;
past it, the key must be looked up again like an unknown one.

A key found not to exist is remembered too, by digest, for
`negative_seconds`, so that repeating a wrong key costs no lookup.

Pure bookkeeping: the caller passes the time in and runs the lookups. Both
maps are bounded; the entry dropped first is the one confirmed longest ago.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmquota.domain.keys import KeyOwner

DEFAULT_MAX_ENTRIES = 10_000


@dataclass(slots=True)
class _Known:
    owner: KeyOwner
    # When the store last said the key exists.
    confirmed_at: float
    # When the next use of the key should start a background lookup.
    refresh_at: float


class KeyCache:
    """Known keys with an age, and recently refused digests."""

    def __init__(
        self,
        refresh_seconds: float,
        max_stale_seconds: float,
        negative_seconds: float,
        max_entries: int = DEFAULT_MAX_ENTRIES,
    ) -> None:
        self.refresh_seconds = refresh_seconds
        self.max_stale_seconds = max_stale_seconds
        self.negative_seconds = negative_seconds
        self.max_entries = max_entries
        self._known: dict[bytes, _Known] = {}
        # digest -> when the refusal is forgotten; in insertion (= expiry) order.
        self._refused: dict[bytes, float] = {}

    def known(self, digest: bytes, now: float) -> KeyOwner | None:
        """The owner of a key confirmed within the stale window; None otherwise."""
        entry = self._known.get(digest)
        if entry is None:
            return None
        if now - entry.confirmed_at > self.max_stale_seconds:
            # Too old to vouch for, even during an outage: look it up again.
            del self._known[digest]
            return None
        return entry.owner

    def claim_refresh(self, digest: bytes, now: float) -> bool:
        """Whether this use should start a background lookup of the key.

        True at most once per `refresh_seconds` per key: the claim moves the
        next refresh on, so a failed refresh (an outage) is retried only then.
        """
        entry = self._known.get(digest)
        if entry is None or now < entry.refresh_at:
            return False
        entry.refresh_at = now + self.refresh_seconds
        return True

    def confirm(self, digest: bytes, owner: KeyOwner, now: float) -> None:
        """The store says the key exists: remember it, fresh."""
        self._refused.pop(digest, None)
        # Re-inserted at the end, so the map stays in order of confirmation.
        self._known.pop(digest, None)
        if len(self._known) >= self.max_entries:
            del self._known[next(iter(self._known))]
        self._known[digest] = _Known(owner, now, now + self.refresh_seconds)

    def forget(self, digest: bytes) -> None:
        """The store says the key is gone: stop vouching for it."""
        self._known.pop(digest, None)

    def refuse(self, digest: bytes, now: float) -> None:
        """The store says no such key: answer 401 for it without a lookup for a while."""
        self._known.pop(digest, None)
        if self.negative_seconds <= 0:
            return
        self._refused.pop(digest, None)
        self._drop_expired_refusals(now)
        if len(self._refused) >= self.max_entries:
            del self._refused[next(iter(self._refused))]
        self._refused[digest] = now + self.negative_seconds

    def refused(self, digest: bytes, now: float) -> bool:
        """Whether the store said, within `negative_seconds`, that no such key exists."""
        until = self._refused.get(digest)
        if until is None:
            return False
        if until <= now:
            del self._refused[digest]
            return False
        return True

    def _drop_expired_refusals(self, now: float) -> None:
        while self._refused:
            digest, until = next(iter(self._refused.items()))
            if until > now:
                return
            del self._refused[digest]

    def __len__(self) -> int:
        return len(self._known)
