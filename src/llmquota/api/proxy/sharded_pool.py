"""One upstream's connections as several small pools, not one large one.

httpcore's connection pool walks every connection it holds on each request
sent and each answer closed (`_assign_requests_to_connections`), asking each
whether it has expired, which polls its socket: a system call per
connection, twice per request (encode/httpcore#1035, open upstream). With
PROXY_MAX_CONNECTIONS at 200 and 64 streams open, that walk was a third of
the proxy's CPU (py-spy on `bench/proxy_overhead.py`'s 64-stream load).

So an upstream's client sends through a transport that holds
ceil(capacity / POOL_CONNECTIONS) pools of POOL_CONNECTIONS connections
each, and sends each request through the pool with the fewest answers open.
The walk then covers at most POOL_CONNECTIONS connections. The pools
together never hold more than the capacity: the upstream's ConnectionShares
(pool.py) lets at most `capacity` requests hold a slot, a slot is released
only after its answer is closed, and choosing the least-busy pool keeps each
one at or below ceil(capacity / pools) <= POOL_CONNECTIONS answers open, so
no request waits inside httpcore for a connection while another pool has
one free. (Idle connections kept alive may reach pools x their size, a few
over the setting when it is not a multiple of the pool count.)
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator

import httpx

# Connections per pool: small enough that a pool's walk is cheap, large
# enough that a pool keeps a few idle connections to reuse.
POOL_CONNECTIONS = 8


class ShardedTransport(httpx.AsyncBaseTransport):
    """Sends each request through the least-busy of several connection pools."""

    def __init__(self, capacity: int) -> None:
        count = max(1, math.ceil(capacity / POOL_CONNECTIONS))
        each = math.ceil(capacity / count)
        limits = httpx.Limits(max_connections=each, max_keepalive_connections=each)
        # One TLS context for all: building one loads the CA bundle (20 ms each).
        # Not from SSL_CERT_FILE / SSL_CERT_DIR: the client trusts no environment.
        tls = httpx.create_ssl_context(trust_env=False)
        self.pools = [httpx.AsyncHTTPTransport(verify=tls, limits=limits) for _ in range(count)]
        # Answers open per pool: sent and not yet closed.
        self.open = [0] * count

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        index = self.open.index(min(self.open))
        self.open[index] += 1
        try:
            response = await self.pools[index].handle_async_request(request)
        except BaseException:
            self.open[index] -= 1
            raise
        assert isinstance(response.stream, httpx.AsyncByteStream)
        response.stream = _CountedStream(response.stream, self, index)
        return response

    def closed(self, index: int) -> None:
        self.open[index] -= 1

    async def aclose(self) -> None:
        for pool in self.pools:
            await pool.aclose()


class _CountedStream(httpx.AsyncByteStream):
    """An answer's body that tells its pool's count when it is closed (once)."""

    def __init__(self, stream: httpx.AsyncByteStream, owner: ShardedTransport, index: int) -> None:
        self.stream = stream
        self.owner: ShardedTransport | None = owner
        self.index = index

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self.stream.__aiter__()

    async def aclose(self) -> None:
        owner, self.owner = self.owner, None
        try:
            await self.stream.aclose()
        finally:
            if owner is not None:
                owner.closed(self.index)
