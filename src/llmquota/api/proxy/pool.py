"""Upstream connections shared fairly between tenants.

Each upstream has its own pool of connections (PROXY_MAX_CONNECTIONS), and
a request must hold one of its slots from the moment it is sent until the
upstream's answer is closed: a whole answer read, or a stream's last byte,
including the drain that outlives a client who hung up. Without shares, one
tenant that opens many streams to an upstream that hangs holds every
connection, and every other tenant's next request waits for the pool.

So a tenant holds at most its share of a pool (PROXY_TENANT_CONNECTION_SHARE
of it, never all of it): past that its next request is refused at once,
naming the reason (429, the tenant's own doing). When the pool itself is
full, a request waits a short while (PROXY_POOL_WAIT_MS) for a slot and is
then refused as busy (503), never left to hang. And drains of abandoned
streams are capped per tenant (PROXY_TENANT_MAX_DRAINS): past the cap, a
further hang-up of that tenant cancels its upstream instead of draining it,
settling the output counted so far, so abandoned streams cannot pin its
share either.

All of this is per worker process, as the pool is.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field


class PoolRefusal(Exception):
    """A request refused a connection: `status` 429 (the tenant's share) or 503 (busy)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class ConnectionShares:
    """The slots of one upstream's pool, counted per tenant."""

    upstream: str
    capacity: int
    tenant_share: float
    wait_seconds: float
    max_drains: int
    _held: dict[str, int] = field(default_factory=dict)
    _draining: dict[str, int] = field(default_factory=dict)
    _in_use: int = 0
    _freed: asyncio.Condition = field(default_factory=asyncio.Condition)

    @property
    def tenant_limit(self) -> int:
        """The most slots one tenant holds: its share, at least one, never the whole pool."""
        share = max(1, math.floor(self.capacity * self.tenant_share))
        return min(share, max(1, self.capacity - 1))

    def held(self, tenant: str) -> int:
        return self._held.get(tenant, 0)

    @property
    def in_use(self) -> int:
        return self._in_use

    async def acquire(self, tenant: str) -> Slot:
        """Take a slot for `tenant`, or raise PoolRefusal."""
        limit = self.tenant_limit
        if self.held(tenant) >= limit:
            raise PoolRefusal(
                429,
                f"tenant {tenant!r} holds its share of the connections to upstream "
                f"{self.upstream!r} ({limit} of {self.capacity}); retry when one of its "
                "requests has finished",
            )
        if self._in_use >= self.capacity:
            async with self._freed:
                try:
                    await asyncio.wait_for(
                        self._freed.wait_for(lambda: self._in_use < self.capacity),
                        self.wait_seconds,
                    )
                except TimeoutError:
                    raise PoolRefusal(
                        503,
                        f"every connection to upstream {self.upstream!r} is in use "
                        f"({self.capacity}); retry shortly",
                    ) from None
            if self.held(tenant) >= limit:  # its own requests took the slots meanwhile
                raise PoolRefusal(
                    429,
                    f"tenant {tenant!r} holds its share of the connections to upstream "
                    f"{self.upstream!r} ({limit} of {self.capacity})",
                )
        self._in_use += 1
        self._held[tenant] = self.held(tenant) + 1
        return Slot(self, tenant)

    def _release(self, tenant: str) -> None:
        left = self.held(tenant) - 1
        if left > 0:
            self._held[tenant] = left
        else:
            self._held.pop(tenant, None)
        self._in_use -= 1
        asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._freed:
            self._freed.notify(1)

    def draining(self, tenant: str) -> int:
        return self._draining.get(tenant, 0)

    def _drain_started(self, tenant: str) -> None:
        self._draining[tenant] = self.draining(tenant) + 1

    def _drain_ended(self, tenant: str) -> None:
        left = self.draining(tenant) - 1
        if left > 0:
            self._draining[tenant] = left
        else:
            self._draining.pop(tenant, None)


@dataclass
class Slot:
    """One tenant's hold on one connection of an upstream's pool, until released."""

    shares: ConnectionShares
    tenant: str
    _draining: bool = False
    _released: bool = False

    def may_drain(self) -> bool:
        """Whether this stream, abandoned by its client, may be drained: the tenant
        has fewer than the cap of drains running (else it is cancelled)."""
        return self.shares.draining(self.tenant) < self.shares.max_drains

    def start_drain(self) -> None:
        """The client hung up and the upstream is read on: count it against the tenant."""
        if not self._draining and not self._released:
            self._draining = True
            self.shares._drain_started(self.tenant)

    def release(self) -> None:
        """The upstream's answer is closed: the slot (and any drain) is given back. Once."""
        if self._released:
            return
        self._released = True
        if self._draining:
            self.shares._drain_ended(self.tenant)
        self.shares._release(self.tenant)
