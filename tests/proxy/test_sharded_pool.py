"""An upstream's connections as several small pools (api/proxy/sharded_pool.py).

Against the fake provider over real sockets: streams that stay open (a model
that hangs after its first word) spread over the pools, never more open in
one pool than its share, never more connections than the capacity; closed
answers give their count back once, and a send that fails takes none.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import httpx

from llmquota.api.proxy.sharded_pool import POOL_CONNECTIONS, ShardedTransport
from tests.proxy.conftest import serving
from tests.proxy.fake_provider import PROVIDER_KEY, FakeProvider

HANGS = "gpt-4o-hang"
CAPACITY = 20  # three pools of seven


@contextlib.asynccontextmanager
async def client_of_fake(transport: ShardedTransport) -> AsyncIterator[httpx.AsyncClient]:
    """A client sending through `transport` to a fake provider whose HANGS model hangs."""
    provider = FakeProvider(hang_models={HANGS})
    async with (
        serving(provider.app()) as url,
        httpx.AsyncClient(base_url=url, transport=transport) as client,
    ):
        yield client


def connections(transport: ShardedTransport) -> list[int]:
    """Connections each pool holds now (httpcore's own count)."""
    return [len(pool._pool.connections) for pool in transport.pools]


async def open_stream(client: httpx.AsyncClient) -> httpx.Response:
    """A stream of the hanging model, its first bytes read; left open. Its reading
    iterator is kept on the response: an abandoned one is finalized by the
    garbage collector, which closes its connection under the pool."""
    request = client.build_request(
        "POST",
        "/v1/chat/completions",
        json={"model": HANGS, "messages": [{"role": "user", "content": "hi"}], "stream": True},
        headers={"Authorization": f"Bearer {PROVIDER_KEY}"},
    )
    response = await client.send(request, stream=True)
    assert response.status_code == 200
    reading = response.aiter_raw()
    response.extensions["test_reading"] = reading
    await anext(reading)
    return response


async def test_open_streams_spread_over_the_pools_and_never_past_the_capacity() -> None:
    transport = ShardedTransport(CAPACITY)
    assert len(transport.pools) == 3 and POOL_CONNECTIONS == 8
    async with client_of_fake(transport) as client:
        streams = await asyncio.gather(*(open_stream(client) for _ in range(CAPACITY)))
        assert sorted(transport.open) == [6, 7, 7]
        assert sorted(connections(transport)) == [6, 7, 7]
        for response in streams[:10]:
            await response.aclose()
        assert sum(transport.open) == 10
        # Ten more: each goes to a pool where an answer closed (a stream closed
        # before its end closes its connection too, so each opens a new one).
        streams[:10] = await asyncio.gather(*(open_stream(client) for _ in range(10)))
        assert sorted(transport.open) == [6, 7, 7]
        assert sum(connections(transport)) == CAPACITY
        for response in streams:
            await response.aclose()
        assert transport.open == [0, 0, 0]


async def test_a_closed_answer_counts_once_and_a_failed_send_not_at_all() -> None:
    transport = ShardedTransport(CAPACITY)
    async with client_of_fake(transport) as client:
        response = await open_stream(client)
        assert sum(transport.open) == 1
        await response.aclose()
        await response.aclose()
        assert transport.open == [0, 0, 0]
        # Answers read to their end leave their connection to the next request.
        body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}
        headers = {"Authorization": f"Bearer {PROVIDER_KEY}"}
        for _ in range(30):
            answer = await client.post("/v1/chat/completions", json=body, headers=headers)
            assert answer.status_code == 200
        assert transport.open == [0, 0, 0]
        assert sum(connections(transport)) == 1
    with socket.socket() as unused:  # a port nothing listens on
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    refused = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", transport=transport)
    async with refused:
        for _ in range(3):
            with contextlib.suppress(httpx.ConnectError):
                await refused.get("/")
        assert transport.open == [0, 0, 0]


def test_one_pool_for_a_small_capacity_and_pools_of_at_most_eight_for_a_large_one() -> None:
    assert len(ShardedTransport(1).pools) == 1
    assert len(ShardedTransport(8).pools) == 1
    large = ShardedTransport(200)
    assert len(large.pools) == 25
    assert {pool._pool._max_connections for pool in large.pools} == {8}
