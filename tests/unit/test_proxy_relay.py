"""The stream relay on its own: a client that stays connected but reads nothing
is treated as gone after the stall bound, and the reservation is finished once,
by drain (the provider's final usage) or by cancel (what was counted)."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from llmquota.api.proxy.exchange import UsageTracker
from llmquota.api.proxy.stream import QUEUE_EVENTS, StreamRelay


class FakeExchange:
    """Records how the reservation was finished."""

    def __init__(self) -> None:
        self.reservation_id = uuid.uuid4()
        self.finished: list[tuple[str, int | None]] = []

    async def finish(self, tracker: UsageTracker, outcome: str) -> None:
        self.finished.append((outcome, tracker.output_tokens))

    def relayed(self) -> None:
        """The relay saw output; nothing to mark without a store."""

    async def keep_alive(self, _every_seconds: float) -> None:
        await asyncio.Event().wait()


def chunk(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


async def events(count: int, delay: float = 0.0) -> AsyncIterator[bytes]:
    for i in range(count):
        await asyncio.sleep(delay)
        yield chunk({"choices": [{"index": 0, "delta": {"content": f" w{i}"}}]})
    usage = {"prompt_tokens": 5, "completion_tokens": 99}
    yield chunk({"choices": [], "usage": usage})
    yield b"data: [DONE]\n\n"


def relay(exchange: FakeExchange, source: AsyncIterator[bytes], mode: str) -> StreamRelay:
    return StreamRelay(
        exchange,  # type: ignore[arg-type]
        httpx.Response(200, content=source),
        UsageTracker("openai"),
        hold_back_usage=True,
        disconnect=mode,
        drain_seconds=5.0,
        heartbeat_seconds=60.0,
        stall_seconds=0.2,
    )


@pytest.mark.parametrize(
    ("mode", "count", "delay", "expected"),
    [("drain", 3 * QUEUE_EVENTS, 0.0, ("ok", 99)), ("cancel", 100_000, 0.001, ("cancelled", None))],
)
async def test_a_client_that_reads_nothing_is_treated_as_gone(
    mode: str, count: int, delay: float, expected: tuple[str, int | None]
) -> None:
    exchange = FakeExchange()
    stalled = relay(exchange, events(count, delay), mode)
    pumps: set[asyncio.Task[None]] = set()
    stalled.start(pumps)
    assert stalled.pump_task is not None
    # Nobody reads stalled.body(): the queue fills, the stall bound passes.
    await asyncio.wait_for(asyncio.gather(stalled.pump_task, return_exceptions=True), 10)
    assert stalled.client_gone
    assert exchange.finished == [expected]
    assert pumps == set()
