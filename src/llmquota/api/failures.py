"""Failed authentications per client address, so that a flood of wrong keys is cheap to refuse.

A wrong key costs a database lookup the first time it is seen, and a random
key is always seen for the first time: the negative key cache cannot stop a
flood of them. So each client address has a small token bucket of failed
authentications in each worker; once it is empty, that client's requests
with keys the worker cannot vouch for are refused with 429 before any
database work, until the bucket refills. Requests with a known key are
never counted or refused here, so a tenant that shares an address with the
flooder (a NAT, a proxy) keeps working.

The table is bounded: past `max_clients` the client that failed least
recently is forgotten (its bucket starts full again), and a bucket that has
refilled completely is dropped when next seen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_MAX_CLIENTS = 10_000


@dataclass(slots=True)
class _Bucket:
    tokens: float
    updated_at: float


class FailureBudget:
    """Per-client token buckets of failed authentications, for one worker."""

    def __init__(
        self, per_second: float, burst: int, max_clients: int = DEFAULT_MAX_CLIENTS
    ) -> None:
        self.per_second = per_second
        self.burst = burst
        self.max_clients = max_clients
        # In order of the last failure, oldest first.
        self._buckets: dict[str, _Bucket] = {}

    def retry_after_ms(self, client: str, now: float) -> int | None:
        """None when the client may still fail; else how long until it may again."""
        bucket = self._refilled(client, now)
        if bucket is None or bucket.tokens >= 1.0:
            return None
        return max(1, math.ceil((1.0 - bucket.tokens) / self.per_second * 1_000))

    def spend(self, client: str, now: float) -> int | None:
        """Take one failure from the client's budget: None when it had one, else (taking
        nothing) how long until it has.

        Taken before the lookup that may fail, and given back if the key turns
        out to exist: concurrent lookups of one client cannot overdraw it.
        """
        retry_after_ms = self.retry_after_ms(client, now)
        if retry_after_ms is not None:
            return retry_after_ms
        bucket = self._buckets.pop(client, None)  # re-inserted last: it failed most recently
        if bucket is None:
            if len(self._buckets) >= self.max_clients:
                del self._buckets[next(iter(self._buckets))]
            bucket = _Bucket(float(self.burst), now)
        bucket.tokens -= 1.0
        self._buckets[client] = bucket
        return None

    def refund(self, client: str, now: float) -> None:
        """Give back a failure taken for a lookup that found the key."""
        bucket = self._refilled(client, now)
        if bucket is not None:
            bucket.tokens = min(float(self.burst), bucket.tokens + 1.0)

    def _refilled(self, client: str, now: float) -> _Bucket | None:
        """The client's bucket refilled to now; None when it would be full."""
        bucket = self._buckets.get(client)
        if bucket is None:
            return None
        bucket.tokens = min(
            float(self.burst), bucket.tokens + (now - bucket.updated_at) * self.per_second
        )
        bucket.updated_at = now
        if bucket.tokens >= self.burst:
            del self._buckets[client]
            return None
        return bucket

    def __len__(self) -> int:
        return len(self._buckets)
