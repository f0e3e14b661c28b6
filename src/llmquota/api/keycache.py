"""A worker's memory of API keys: those that exist, refreshed while in use, and those that do not.

Authentication must not need the database on every request, nor at all
while the database is away: a request nobody can authenticate never reaches
its failure mode, so an outage would turn `open` and `local` into `closed`.
So a key found once is remembered, and a use of it past `refresh_seconds`
claims a background lookup while the remembered answer keeps serving. A key
in use thus stays fresh, a key deleted from the database is forgotten as soon
as the database announces it (Authenticator.key_changed), else at its next
refresh, and during an outage (the refresh fails) a known key keeps
working for `max_stale_seconds`, the window the policy cache decides by;
past it, the key must be looked up again like an unknown one.

A key that ends (its expiry, or the end of a rotation's grace for its old
secret) is remembered with how long it had left when looked up, measured on
the database's clock and counted down on this worker's monotonic one, so it is
refused at its end without an announcement. A suspension or resumption of a
tenant is announced by tenant name (migration 0018): its keys are dropped, so
their next use reads the tenant's state with the key.

A lookup that was under way when a change of its key was announced (or made
on this worker) may have read the row from before the change: its answer is
not remembered (`generation` stamps each change; `confirm` and `refuse` take
the generation the lookup started at), so a refresh in flight cannot put a
revoked key back.

A key found not to exist is remembered too, by digest, for
`negative_seconds`, so that repeating a wrong key costs no lookup.

A key whose row changed while this worker knew it (or while a lookup was
confirming it) is not a stranger: until looked up again it is remembered as
its tenant's (`former_tenant`), so that its requests queue in that tenant's
lane (api/fairness.py) rather than overflowing the small lane of unknown keys
with 429s. The lookup still decides whether it is served.

Pure bookkeeping: the caller passes the time in and runs the lookups. The
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
    # When this secret stops being valid (expiry, end of grace); None: never.
    valid_until: float | None


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
        # A counter of changes, and the last change of each digest, key id and
        # tenant (and of all keys at once), for lookups in flight to compare with.
        self.generation = 0
        self._changed: dict[bytes | int | str, int] = {}
        self._all_changed = -1
        # digest -> tenant of a key this worker knew (or was confirming) when its row
        # changed, until it is looked up again: its requests meanwhile queue in that
        # tenant's lane (Authenticator.triage), not in the small lane of keys nobody
        # vouches for, where a busy tenant's burst would overflow into 429s.
        self._rechecking: dict[bytes, str] = {}

    def known(self, digest: bytes, now: float) -> KeyOwner | None:
        """The owner of a key confirmed within the stale window; None otherwise."""
        entry = self._known.get(digest)
        if entry is None:
            return None
        if entry.valid_until is not None and now >= entry.valid_until:
            # Expired or rotated out: looked up again, found no more, refused.
            del self._known[digest]
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

    def changed_since(self, digest: bytes, owner: KeyOwner | None, generation: int) -> bool:
        """Whether the key may have changed after a lookup that started at `generation`."""
        marks = [self._all_changed, self._changed.get(digest, -1)]
        if owner is not None:
            marks.append(self._changed.get(owner.key_id, -1))
            if owner.tenant is not None:
                marks.append(self._changed.get(owner.tenant, -1))
        return max(marks) > generation

    def _mark(self, *what: bytes | int | str) -> None:
        self.generation += 1
        if len(self._changed) >= self.max_entries:
            # Forgetting the marks is safe: every lookup in flight counts as stale.
            self._changed.clear()
            self._all_changed = self.generation
        for item in what:
            self._changed[item] = self.generation

    def confirm(self, digest: bytes, owner: KeyOwner, now: float, since: int | None = None) -> None:
        """The store says the key exists: remember it, fresh (unless the lookup that
        says so started at `since` and the key changed after)."""
        if since is not None and self.changed_since(digest, owner, since):
            self._recheck(digest, owner)
            return
        self._refused.pop(digest, None)
        self._rechecking.pop(digest, None)
        # Re-inserted at the end, so the map stays in order of confirmation.
        self._known.pop(digest, None)
        if len(self._known) >= self.max_entries:
            del self._known[next(iter(self._known))]
        valid_until = None if owner.valid_seconds is None else now + owner.valid_seconds
        self._known[digest] = _Known(owner, now, now + self.refresh_seconds, valid_until)

    def forget(self, digest: bytes) -> None:
        """The store says the key is gone: stop vouching for it."""
        self._known.pop(digest, None)
        self._rechecking.pop(digest, None)

    def drop(self, digest: bytes) -> None:
        """The key's row changed: forget whether it was found or refused (a known
        key's tenant is kept for its lane until it is looked up again)."""
        self._mark(digest)
        entry = self._known.pop(digest, None)
        if entry is not None:
            self._recheck(digest, entry.owner)
        self._refused.pop(digest, None)

    def drop_key_id(self, key_id: int) -> None:
        """The key with this id changed (revoked or rotated on this worker): forget
        every secret of it."""
        self._mark(key_id)
        for digest in [d for d, entry in self._known.items() if entry.owner.key_id == key_id]:
            self._recheck(digest, self._known.pop(digest).owner)

    def drop_tenant(self, tenant: str) -> None:
        """The tenant's state changed (suspended, resumed): forget its keys."""
        self._mark(tenant)
        for digest in [d for d, entry in self._known.items() if entry.owner.tenant == tenant]:
            self._recheck(digest, self._known.pop(digest).owner)

    def former_tenant(self, digest: bytes) -> str | None:
        """The tenant of a key this worker knew until its row changed, not looked up since."""
        return self._rechecking.get(digest)

    def _recheck(self, digest: bytes, owner: KeyOwner) -> None:
        if owner.tenant is None:
            return
        self._rechecking.pop(digest, None)
        if len(self._rechecking) >= self.max_entries:
            del self._rechecking[next(iter(self._rechecking))]
        self._rechecking[digest] = owner.tenant

    def refresh_all(self) -> None:
        """Any key may have changed: each known key's next use claims a lookup
        (while it keeps serving), and every refusal is forgotten."""
        self.generation += 1
        self._all_changed = self.generation
        for entry in self._known.values():
            entry.refresh_at = 0.0
        self._refused.clear()

    def refuse(self, digest: bytes, now: float, since: int | None = None) -> None:
        """The store says no such key: answer 401 for it without a lookup for a while
        (unless the lookup started at `since` and the key changed after: created)."""
        if since is not None and self.changed_since(digest, None, since):
            return
        self._known.pop(digest, None)
        self._rechecking.pop(digest, None)
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
