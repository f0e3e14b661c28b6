"""The library under an open loop: admissions arriving at a fixed rate, latency from arrival.

A closed loop (comparison 1's callers) never sends faster than answers come
back, so it hides queueing: a slow answer delays the next request instead of
making it wait. Here arrivals come at RATE a second whatever the answers do,
and each one's latency counts from the moment it was due.

The arrivals are made by a process of their own (`_send_arrivals`), so that
the schedule does not share an event loop, or a GIL, with what is measured:
it writes each arrival's due time (the system-wide monotonic clock, as
8 bytes) to a Unix socket, a few at a time as they fall due. The measured
process reads them and starts one task per arrival: `await limiter.admit(...)`
for llmquota (a random tenant of 10,000, exact or allotted), `await
bucket.reserve(...)` for the Redis + Lua bucket, each for one of
ACTIVE_TENANTS tenants at random. Latency is the monotonic
clock at the answer less the due time, so the socket's own delay counts too,
alike for both. Each system runs in a settled process (`settle_after_startup`
once connected, as in comparison 1): unsettled, a full garbage collection
every few seconds stopped the loop for 60-120 ms and was llmquota's p99.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import multiprocessing
import random
import shutil
import socket
import struct
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from bench import redis_lua
from bench.common import percentile, reset_state
from bench.library import (
    ALLOTTED,
    INPUT_TOKENS,
    LLMQUOTA,
    MAX_TOKENS,
    Variant,
    unlimited_bucket,
)
from llmquota import Limiter, RateLimited, settle_after_startup

RATE = 5_000
# Tenants with traffic (of the 10,000 seeded): 50 admissions a second each,
# enough that an allotted tenant's requests come from its slices.
ACTIVE_TENANTS = 100
_DUE = struct.Struct("d")
# The sender wakes this often and sends every arrival that has fallen due.
_TICK_S = 0.0002


@dataclass(frozen=True)
class OpenLoopResult:
    system: str
    rate: int
    sent: int
    answered: int
    p50_ms: float
    p99_ms: float


def _send_arrivals(path: str, rate: int, seconds: float) -> None:
    """The arrival process: once connected, every 1/rate s for `seconds`, its due
    time. (The schedule starts here, not at a time chosen before this process
    started: a slow start would otherwise send a burst of arrivals already late.)"""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.connect(path)
        start = time.monotonic() + 0.1
        interval = 1.0 / rate
        total = int(seconds * rate)
        sent = 0
        while sent < total:
            now = time.monotonic()
            due = min(total, int((now - start) / interval) + 1) if now >= start else 0
            if due > sent:
                connection.sendall(
                    b"".join(_DUE.pack(start + i * interval) for i in range(sent, due))
                )
                sent = due
            time.sleep(_TICK_S)


async def open_loop(
    call: Callable[[], Awaitable[object]], rate: int, seconds: float, warmup_s: float
) -> tuple[int, list[float]]:
    """Arrivals from the sender process for warmup_s + seconds; each one's latency
    in milliseconds, from its due time, for those due after the warm-up (counted
    from the first arrival's due time)."""
    latencies: list[float] = []
    tasks: set[asyncio.Task[None]] = set()
    measured_from = math.inf
    sent = 0

    async def answer(due: float) -> None:
        await call()  # an exception: not answered, left out of `latencies`
        if due >= measured_from:
            latencies.append((time.monotonic() - due) * 1000)

    async def arrivals(reader: asyncio.StreamReader, _writer: asyncio.StreamWriter) -> None:
        nonlocal sent, measured_from
        while chunk := await reader.read(_DUE.size * 1024):
            buffered = chunk
            while len(buffered) % _DUE.size:
                buffered += await reader.readexactly(_DUE.size - len(buffered) % _DUE.size)
            for (due,) in _DUE.iter_unpack(buffered):
                if measured_from == math.inf:
                    measured_from = due + warmup_s
                sent += due >= measured_from
                task = asyncio.ensure_future(answer(due))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        finished.set()

    finished = asyncio.Event()
    path = str(Path(tempfile.mkdtemp(prefix="llmquota-open-loop-")) / "arrivals")
    server = await asyncio.start_unix_server(arrivals, path)
    sender = multiprocessing.get_context("spawn").Process(
        target=_send_arrivals, args=(path, rate, warmup_s + seconds), daemon=True
    )
    sender.start()
    try:
        while not finished.is_set():
            if not sender.is_alive() and sender.exitcode:
                raise RuntimeError(f"the arrival process failed (exit code {sender.exitcode})")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(finished.wait(), 1.0)
        if tasks:
            await asyncio.wait(set(tasks), timeout=30)
    finally:
        for task in tasks:  # unanswered after 30 s: cancelled, counted as not answered
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        server.close()
        sender.join(timeout=10)
        shutil.rmtree(Path(path).parent, ignore_errors=True)
    return sent, latencies


def _result(system: str, rate: int, sent: int, latencies: list[float]) -> OpenLoopResult:
    latencies.sort()
    return OpenLoopResult(
        system, rate, sent, len(latencies), percentile(latencies, 0.5), percentile(latencies, 0.99)
    )


async def llmquota_open_loop(
    dsn: str, variant: Variant, tenants: list[str], *, rate: int, seconds: float
) -> OpenLoopResult:
    await reset_state(dsn, admission="allotted" if variant.allotted else None)
    limiter = await Limiter.connect(dsn, variant.settings())
    settle_after_startup()
    pick = random.Random(7)

    async def call() -> None:
        with contextlib.suppress(RateLimited):  # a refusal is an answer too
            await limiter.admit(
                tenant=pick.choice(tenants),
                model="gpt-4o",
                input_tokens=INPUT_TOKENS,
                max_tokens=MAX_TOKENS,
            )

    try:
        sent, latencies = await open_loop(call, rate, seconds, warmup_s=1.0)
    finally:
        await limiter.close()
    return _result(variant.name, rate, sent, latencies)


async def redis_open_loop(
    host: str, port: int, client: redis_lua.Client, tenants: list[str], *, rate: int, seconds: float
) -> OpenLoopResult:
    bucket = await unlimited_bucket(client, host, port)
    settle_after_startup()
    pick = random.Random(7)

    async def call() -> None:
        await bucket.reserve(pick.choice(tenants), INPUT_TOKENS + MAX_TOKENS)

    try:
        sent, latencies = await open_loop(call, rate, seconds, warmup_s=1.0)
    finally:
        await bucket.close()
    return _result(f"redis-lua, {client.name}", rate, sent, latencies)


async def measure(
    dsn: str,
    redis_host: str,
    redis_port: int,
    client: redis_lua.Client,
    tenants: list[str],
    *,
    seconds: float,
    rate: int = RATE,
) -> list[OpenLoopResult]:
    """llmquota exact, llmquota allotted, then the Redis + Lua bucket on `client`."""
    tenants = tenants[:ACTIVE_TENANTS]
    return [
        await llmquota_open_loop(dsn, LLMQUOTA, tenants, rate=rate, seconds=seconds),
        await llmquota_open_loop(dsn, ALLOTTED, tenants, rate=rate, seconds=seconds),
        await redis_open_loop(redis_host, redis_port, client, tenants, rate=rate, seconds=seconds),
    ]


def summary(results: list[OpenLoopResult]) -> str:
    """The summary line: each system's p50 and p99 at the rate."""
    parts = [
        f"{r.system} p50 {r.p50_ms:.2f} ms, p99 {r.p99_ms:.2f} ms"
        + ("" if r.answered == r.sent else f" ({r.sent - r.answered} unanswered)")
        for r in results
    ]
    return f"library open-loop {results[0].rate}/s: " + "; ".join(parts)
