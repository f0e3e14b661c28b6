"""The edge transport over a real socket pair: one write per turn, in order, flushed on
close; a close lingers only while a request's body may still be coming."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
import uvicorn
from uvicorn.server import ServerState

from llmquota.api.protocols.edge_transport import FLUSH_BYTES, EdgeTransport
from llmquota.api.protocols.httptools_edge import HttpToolsEdgeProtocol


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


async def test_a_big_answer_goes_out_at_once_where_flow_control_sees_it(
    pair: tuple[EdgeTransport, list[bytes], asyncio.StreamReader],
) -> None:
    transport, writes, reader = pair
    transport.write(b"head\r\n\r\n")
    transport.write(b"x" * FLUSH_BYTES)
    # Past FLUSH_BYTES the gathered bytes are written in the same turn.
    assert writes == [b"head\r\n\r\n" + b"x" * FLUSH_BYTES]
    assert transport.get_write_buffer_size() < FLUSH_BYTES + 8  # the inner buffer only
    assert await reader.readexactly(FLUSH_BYTES + 8) == writes[0]


async def test_writes_after_a_lingering_close_are_dropped_not_raised() -> None:
    """A close while the client may still send shuts the sending half; a write
    after it (an earlier pipelined answer finishing) is dropped, as after a close."""
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()
    inner, _protocol = await loop.connect_accepted_socket(Silent, ours)
    reader, writer = await asyncio.open_connection(sock=theirs)
    transport = EdgeTransport(inner, loop, client_may_send=lambda: True)
    transport.write(b"HTTP/1.1 400 Bad Request\r\n\r\n")
    transport.close()
    assert transport.lingering and transport.is_closing()
    transport.write(b"late")
    transport.close()
    await asyncio.sleep(0)
    # The answer, then end of stream (the sending half shut), and nothing late.
    assert await asyncio.wait_for(reader.read(), 5) == b"HTTP/1.1 400 Bad Request\r\n\r\n"
    inner.close()
    writer.close()


async def answer_at_once(scope: Any, receive: Any, send: Any) -> None:
    """An app answering before it reads the body (as a refusal does)."""
    await send(
        {"type": "http.response.start", "status": 401, "headers": [(b"content-length", b"0")]}
    )
    await send({"type": "http.response.body", "body": b""})


async def test_httptools_lingers_only_while_a_body_is_still_coming() -> None:
    """The answer may go out before the body came; once the body is in, a close
    of the kept-alive connection (its idle timeout, a shutdown) does not linger."""
    config = uvicorn.Config(answer_at_once, http=HttpToolsEdgeProtocol, log_level="warning")
    config.load()
    loop = asyncio.get_running_loop()
    protocol = HttpToolsEdgeProtocol(config, ServerState(), app_state={})
    ours, theirs = socket.socketpair()
    await loop.connect_accepted_socket(lambda: protocol, ours)
    protocol.data_received(b"POST /v1/admit HTTP/1.1\r\nHost: x\r\ncontent-length: 10\r\n\r\n01234")
    for _ in range(10):
        await asyncio.sleep(0)  # the app answers 401
    assert protocol.cycle is not None and protocol.cycle.response_complete
    assert protocol._client_may_send()  # half the body is still to come
    protocol.data_received(b"56789")
    assert not protocol._client_may_send()
    protocol.transport.close()
    assert not protocol.linger.lingering
    theirs.close()
