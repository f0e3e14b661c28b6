"""A flood of random API keys, run as a subprocess by the fault tests.

    python flooder.py PORT CONNECTIONS SECONDS

Opens CONNECTIONS keep-alive connections to 127.0.0.1:PORT, prints
{"ready": true}, then on each connection sends POST /v1/admit with a fresh
random key as fast as the answers come back, for SECONDS. Prints one JSON
line with the count of each status. A separate process, with a bare HTTP/1.1
client, so that the flood's own CPU is not the measuring client's.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import sys
import time
from collections import Counter

BODY = b'{"tenant": "quiet", "model": "gpt-4o", "input_tokens": 10, "max_tokens": 10}'


def _request() -> bytes:
    key = "lq_" + secrets.token_urlsafe(32)
    return (
        b"POST /v1/admit HTTP/1.1\r\nHost: llmquota\r\ncontent-type: application/json\r\n"
        + f"authorization: Bearer {key}\r\ncontent-length: {len(BODY)}\r\n\r\n".encode()
        + BODY
    )


async def _answer(reader: asyncio.StreamReader) -> tuple[int, bool]:
    """(status, whether the server closes the connection after it)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.lower().split(b"\r\n")
    length = next(
        int(line.split(b":", 1)[1]) for line in lines if line.startswith(b"content-length:")
    )
    await reader.readexactly(length)
    return int(lines[0].split(b" ", 2)[1]), b"connection: close" in lines


async def _flood(port: int, until: float, counts: Counter[int], ready: asyncio.Event) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    await ready.wait()
    while time.monotonic() < until:
        writer.write(_request())
        status, closing = await _answer(reader)
        counts[status] += 1
        if closing:
            writer.close()
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.close()


async def main(port: int, connections: int, seconds: float) -> None:
    counts: Counter[int] = Counter()
    ready = asyncio.Event()
    until = time.monotonic() + seconds
    tasks = [asyncio.ensure_future(_flood(port, until, counts, ready)) for _ in range(connections)]
    await asyncio.sleep(0.1)
    print(json.dumps({"ready": True}), flush=True)
    ready.set()
    await asyncio.gather(*tasks)
    print(json.dumps({str(status): n for status, n in sorted(counts.items())}), flush=True)


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])))
