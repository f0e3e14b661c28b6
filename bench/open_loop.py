"""An open-loop HTTP load generator: requests at a fixed rate, whatever the answers.

`python -m bench.open_loop --port P --rate 1000 --seconds 10 --tenants 10000 --key K`
prints one JSON object: requests sent and answered, errors, the latency
percentiles, and how late the generator itself was.

Request i is due at start + i / rate and is sent then, on a free keep-alive
connection or on a new one when all are busy, never held back because
earlier answers are slow. Its latency is measured from when it was due, not
from when it went out, so a server (or a generator) that falls behind
shows it in full: no coordinated omission, the mistake a closed loop such as
wrk makes (wrk2 corrects it; it is not in Debian). Raw asyncio streams and
hand-written HTTP/1.1 keep this process's CPU per request small: it shares
the machine with the server it measures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass

# Connections the generator may open; past that a due request waits for one
# (and its wait counts in its latency).
MAX_CONNECTIONS = 512
# Requests due within this much of each other go out in the same turn.
TICK_SECONDS = 0.001
# Not counted: the first requests, while connections are being opened.
WARMUP_SECONDS = 1.0
# An answer slower than this counts as an error (and is still waited for).
ANSWER_TIMEOUT_SECONDS = 30.0
BODY = (
    '{{"tenant": "t{tenant}", "model": "gpt-4o", "max_tokens": 2000, "messages": '
    '[{{"role": "user", "content": "Summarise this contract and list every liability clause."}}]}}'
)


@dataclass(frozen=True)
class OpenLoopResult:
    rate: float
    seconds: float
    sent: int
    # Sent in all, the warm-up's included: what the server's CPU over the run paid for.
    sent_in_all: int
    answered: int
    errors: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    # How late the generator sent requests (its own lag, included in latency).
    send_lag_p99_ms: float
    connections: int


class Client:
    """Keep-alive HTTP/1.1 connections to one server, each carrying one request at a time."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.idle: deque[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = deque()
        self.opened = 0
        self.slots = asyncio.Semaphore(MAX_CONNECTIONS)

    async def post(self, path: str, headers: bytes, body: bytes) -> int:
        """POST and read the whole answer; its status code."""
        async with self.slots:
            if self.idle:
                reader, writer = self.idle.popleft()
            else:
                reader, writer = await asyncio.open_connection(self.host, self.port)
                self.opened += 1
            writer.write(
                b"POST %s HTTP/1.1\r\nHost: %s\r\n%sContent-Length: %d\r\n\r\n%s"
                % (path.encode(), self.host.encode(), headers, len(body), body)
            )
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if length:
                await reader.readexactly(length)
            if b"connection: close" in head.lower():
                writer.close()
            else:
                self.idle.append((reader, writer))
            return status

    def close(self) -> None:
        for _, writer in self.idle:
            writer.close()


def percentile(sorted_values: list[float], fraction: float) -> float:
    if not sorted_values:
        return math.nan
    index = min(len(sorted_values) - 1, max(0, math.ceil(fraction * len(sorted_values)) - 1))
    return sorted_values[index]


async def run(
    host: str, port: int, *, rate: float, seconds: float, tenants: int, key: str
) -> OpenLoopResult:
    client = Client(host, port)
    headers = b"Authorization: Bearer %s\r\nContent-Type: application/json\r\n" % key.encode()
    rng = random.Random(13)
    loop = asyncio.get_running_loop()
    latencies: list[float] = []
    lags: list[float] = []
    errors = 0
    total = round((seconds + WARMUP_SECONDS) * rate)
    counted_from = round(WARMUP_SECONDS * rate)
    start = loop.time() + 0.05

    async def one(index: int, due: float, body: bytes) -> None:
        nonlocal errors
        lag = loop.time() - due
        try:
            status = await asyncio.wait_for(
                client.post("/v1/admit", headers, body), ANSWER_TIMEOUT_SECONDS
            )
            ok = 200 <= status < 300
        except (TimeoutError, OSError, asyncio.IncompleteReadError):
            ok = False
        if index >= counted_from:
            latencies.append(loop.time() - due)
            lags.append(lag)
            errors += not ok

    tasks: set[asyncio.Task[None]] = set()
    sent = 0
    while sent < total:
        now = loop.time()
        while sent < total and start + sent / rate <= now + TICK_SECONDS / 2:
            body = BODY.format(tenant=rng.randrange(tenants) if tenants > 1 else 0).encode()
            task = asyncio.create_task(one(sent, start + sent / rate, body))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            sent += 1
        if sent < total:
            await asyncio.sleep(max(0.0, start + sent / rate - loop.time()))
    await asyncio.gather(*tasks)
    client.close()
    latencies.sort()
    lags.sort()
    return OpenLoopResult(
        rate=rate,
        seconds=seconds,
        sent=total - counted_from,
        sent_in_all=total,
        answered=len(latencies) - errors,
        errors=errors,
        p50_ms=percentile(latencies, 0.50) * 1_000,
        p99_ms=percentile(latencies, 0.99) * 1_000,
        max_ms=(latencies[-1] if latencies else math.nan) * 1_000,
        send_lag_p99_ms=percentile(lags, 0.99) * 1_000,
        connections=client.opened,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--rate", type=float, default=1_000.0, help="requests per second")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--tenants", type=int, default=10_000)
    parser.add_argument("--key", required=True, help="the bearer key")
    args = parser.parse_args()
    started = time.monotonic()
    result = asyncio.run(
        run(
            args.host,
            args.port,
            rate=args.rate,
            seconds=args.seconds,
            tenants=args.tenants,
            key=args.key,
        )
    )
    print(json.dumps({**asdict(result), "wall_seconds": time.monotonic() - started}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
