"""A misbehaving webhook receiver, run as its own process for the fault tests.

`python -m tests.hostile_receiver trickle` answers every POST one byte every
TRICKLE_SECONDS (the status line never completes in any sane time);
`python -m tests.hostile_receiver huge` answers 200 with a body of
HUGE_BODY_BYTES, written as fast as the socket takes it. Both read the whole
request first, count it, and print their port on the first line of stdout,
then one line per request answered ("request N").
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable

TRICKLE_SECONDS = 4.0
HUGE_BODY_BYTES = 300 * 1024 * 1024
CHUNK = b"\0" * (1024 * 1024)


async def _read_request(reader: asyncio.StreamReader) -> bool:
    """Read one HTTP/1.1 request with a Content-Length body; False at EOF."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    await reader.readexactly(length)
    return True


def _handler(mode: str) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
    served = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal served
        try:
            while await _read_request(reader):
                served += 1
                print(f"request {served}", flush=True)
                if mode == "trickle":
                    for byte in b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n":
                        writer.write(bytes([byte]))
                        await writer.drain()
                        await asyncio.sleep(TRICKLE_SECONDS)
                else:
                    writer.write(
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\n"
                        + f"content-length: {HUGE_BODY_BYTES}\r\n\r\n".encode()
                    )
                    for _ in range(HUGE_BODY_BYTES // len(CHUNK)):
                        writer.write(CHUNK)
                        await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    return handle


async def main(mode: str) -> None:
    server = await asyncio.start_server(_handler(mode), "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ("trickle", "huge"):
        raise SystemExit("usage: python -m tests.hostile_receiver trickle|huge")
    asyncio.run(main(sys.argv[1]))
