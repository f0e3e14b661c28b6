"""The edge transport over a real socket pair: one write per turn, in order, flushed on close."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import pytest

from llmquota.api.protocols.edge_transport import EdgeTransport


class Silent(asyncio.Protocol):
    """The server side's protocol: nothing to read."""


@pytest.fixture
async def pair() -> AsyncIterator[tuple[EdgeTransport, list[bytes], asyncio.StreamReader]]:
    """An EdgeTransport over one end of a socket pair, the writes its inner
    transport got, and a reader on the other end."""
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()
    inner, _protocol = await loop.connect_accepted_socket(Silent, ours)
    writes: list[bytes] = []
    real_write = inner.write

    def write(data: bytes | bytearray | memoryview) -> None:
        writes.append(bytes(data))
        real_write(data)

    inner.write = write  # type: ignore[method-assign]
    reader, writer = await asyncio.open_connection(sock=theirs)
    transport = EdgeTransport(inner, loop, client_may_send=lambda: False)
    yield transport, writes, reader
    transport.close()
    writer.close()


async def test_the_writes_of_one_turn_go_out_in_one_call_in_order(
    pair: tuple[EdgeTransport, list[bytes], asyncio.StreamReader],
) -> None:
    transport, writes, reader = pair
    transport.write(b"HTTP/1.1 201 Created\r\ncontent-length: 5\r\n\r\n")
    transport.write(bytearray(b"hello"))
    assert writes == []  # nothing until the turn ends
    assert transport.get_write_buffer_size() == 48
    await asyncio.sleep(0)
    assert writes == [b"HTTP/1.1 201 Created\r\ncontent-length: 5\r\n\r\nhello"]
    assert await reader.readexactly(48) == writes[0]


async def test_writes_of_separate_turns_stay_separate_and_in_order(
    pair: tuple[EdgeTransport, list[bytes], asyncio.StreamReader],
) -> None:
    transport, writes, reader = pair
    for chunk in (b"data: 1\n\n", b"data: 2\n\n", b"data: 3\n\n"):
        transport.write(chunk)
        await asyncio.sleep(0)
    assert writes == [b"data: 1\n\n", b"data: 2\n\n", b"data: 3\n\n"]
    assert await reader.readexactly(27) == b"".join(writes)


async def test_close_sends_what_the_turn_gathered_then_closes(
    pair: tuple[EdgeTransport, list[bytes], asyncio.StreamReader],
) -> None:
    transport, writes, reader = pair
    transport.write(b"last words")
    transport.close()
    assert writes == [b"last words"]
    assert await asyncio.wait_for(reader.read(), 5) == b"last words"  # then EOF
    await asyncio.sleep(0)
    assert writes == [b"last words"]  # the turn's flush finds nothing left
