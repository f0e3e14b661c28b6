"""Relaying a provider's server-sent events to the client, chunk by chunk.

The upstream is read by a task of its own (the pump), not by the response:
the pump outlives a client that hangs up, so that in `drain` mode it reads
the provider to its final usage (bounded by LLMQUOTA_PROXY_DRAIN_SECONDS)
and in `cancel` mode it is cancelled, closes the upstream and settles the
output counted so far. Either way the pump, and only the pump, finishes the
reservation, once. Events pass through as they arrive through a small
bounded queue (backpressure, no buffering of the whole stream). When the
proxy asked OpenAI for the usage chunk itself (the client did not), the
client sees the stream it asked for: the usage-only chunk is held back, and
the `"usage": null` every other chunk then carries is taken out of it. A
client that asked gets every byte unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable, Mapping

import httpx
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from llmquota.api.proxy.exchange import Exchange, UsageTracker
from llmquota.api.proxy.metrics import CallMetrics
from llmquota.api.proxy.pool import Slot
from llmquota.api.proxy.wire import Kind, error_body
from llmquota.domain.json_limits import loads_bounded
from llmquota.domain.response_cache import MAX_CACHED_BODY_BYTES
from llmquota.domain.vocabulary import Outcome

log = logging.getLogger(__name__)

QUEUE_EVENTS = 64
MAX_EVENT_BYTES = 16 * 1_048_576


async def sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Whole SSE events (each with its blank-line terminator) from a byte stream."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk.replace(b"\r\n", b"\n")
        while (end := buffer.find(b"\n\n")) >= 0:
            yield buffer[: end + 2]
            buffer = buffer[end + 2 :]
        if len(buffer) > MAX_EVENT_BYTES:
            raise ValueError("an upstream event is larger than 16 MiB")
    if buffer.strip():
        yield buffer + b"\n\n"


def event_data(event: bytes) -> object:
    """The JSON of an event's `data:` lines; None for [DONE], comments or non-JSON."""
    lines = [
        line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")
    ]
    if not lines:
        return None
    data = b"\n".join(lines)
    if data.strip() == b"[DONE]":
        return None
    try:
        return loads_bounded(data)
    except ValueError:  # not JSON, or nested absurdly deep: relayed, not read
        return None


def without_usage(event: bytes, data: object) -> bytes:
    """`event` without the `"usage": null` the client did not ask for; else unchanged."""
    if not isinstance(data, dict) or "usage" not in data or data["usage"] is not None:
        return event
    rest = {k: v for k, v in data.items() if k != "usage"}
    other = [line for line in event.split(b"\n") if line and not line.startswith(b"data:")]
    payload = json.dumps(rest, ensure_ascii=False, separators=(",", ":")).encode()
    return b"".join(line + b"\n" for line in other) + b"data: " + payload + b"\n\n"


def error_event(kind: Kind) -> bytes:
    """The event each SDK raises on when a stream breaks off (502: the provider failed)."""
    data = json.dumps(error_body(kind, 502, "the provider's stream broke off")).encode()
    prefix = b"event: error\n" if kind == "anthropic" else b""
    return prefix + b"data: " + data + b"\n\n"


class StreamRelay:
    """Pumps one upstream stream into the client's response and settles it."""

    def __init__(
        self,
        exchange: Exchange,
        upstream: httpx.Response,
        tracker: UsageTracker,
        *,
        hold_back_usage: bool,
        disconnect: str,
        drain_seconds: float,
        heartbeat_seconds: float,
        stall_seconds: float = 300.0,
        metrics: CallMetrics | None = None,
        scrub: Callable[[bytes], bytes] = bytes,
        slot: Slot | None = None,
        on_complete: Callable[[bytes, UsageTracker], None] | None = None,
    ) -> None:
        self.exchange = exchange
        self.upstream = upstream
        self.tracker = tracker
        self.hold_back_usage = hold_back_usage
        self.disconnect = disconnect
        self.drain_seconds = drain_seconds
        self.heartbeat_seconds = heartbeat_seconds
        self.stall_seconds = stall_seconds
        self.metrics = metrics
        # Every relayed event goes through it: the provider key never reaches a client.
        self.scrub = scrub
        # The upstream connection this stream holds, until its upstream is closed.
        self.slot = slot
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue(QUEUE_EVENTS)
        self.client_gone = False
        self.completed = False
        # Whether the provider's output has started coming through.
        self.relayed = False
        self.pump_task: asyncio.Task[None] | None = None
        # The response cache's copy of the stream as the provider sent it
        # (api/proxy/cache.py), handed to `on_complete` if it runs to its end
        # within the cache's size bound.
        self.on_complete = on_complete
        self.transcript: list[bytes] | None = [] if on_complete is not None else None
        self._transcript_bytes = 0

    def start(self, tasks: set[asyncio.Task[None]]) -> None:
        """Start the pump; `tasks` holds it until it has settled."""
        self.pump_task = asyncio.get_running_loop().create_task(self.pump())
        tasks.add(self.pump_task)
        self.pump_task.add_done_callback(tasks.discard)

    async def pump(self) -> None:
        """Read upstream to its end (or cancellation), forward, then finish the reservation."""
        keep_alive = asyncio.get_running_loop().create_task(
            self.exchange.keep_alive(self.heartbeat_seconds)
        )
        outcome: Outcome = "ok"
        try:
            async for event in sse_events(self.upstream.aiter_bytes()):
                self._record(event)
                data = event_data(event)
                usage_only = self.tracker.observe(data)
                self._observe_output()
                if self.client_gone or (usage_only and self.hold_back_usage):
                    continue
                relayed = without_usage(event, data) if self.hold_back_usage else event
                await self._forward(self.scrub(relayed))
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except (httpx.HTTPError, ValueError) as exc:
            log.warning("upstream stream of %s failed: %s", self.exchange.reservation_id, exc)
            outcome = "error"
            if self.metrics is not None:
                self.metrics.failed(exc, mid_stream=True)
            if not self.client_gone:  # tell the client in its SDK's terms, not by a clean end
                await self.queue.put(error_event(self.tracker.kind))
        finally:
            keep_alive.cancel()
            if outcome == "ok" and self.tracker.failed:
                outcome = "error"
                if self.metrics is not None:  # the provider's own error event, in the stream
                    self.metrics.error("stream_error")
            self._observe_end(outcome)
            if outcome == "ok" and self.on_complete is not None and self.transcript is not None:
                self.on_complete(b"".join(self.transcript), self.tracker)
            await asyncio.shield(self._close(outcome))

    def _record(self, event: bytes) -> None:
        """Keep the event for the cache, until the stream outgrows its bound."""
        if self.transcript is None:
            return
        self._transcript_bytes += len(event)
        if self._transcript_bytes > MAX_CACHED_BODY_BYTES:
            self.transcript = None
        else:
            self.transcript.append(event)

    def _observe_output(self) -> None:
        if self.relayed or not self.tracker.produced():
            return
        self.relayed = True
        self.exchange.relayed()  # the store learns it with the next heartbeat, sent at once
        calls = self.metrics
        if calls is not None and calls.first_output_at is None:
            calls.output()

    def _observe_end(self, outcome: Outcome) -> None:
        calls = self.metrics
        if calls is None:
            return
        calls.drain_ended()
        if outcome == "ok":
            calls.stream_ended(self.tracker.output_tokens if self.tracker.final else None)

    async def _forward(self, event: bytes) -> None:
        """Queue an event for the client; a client that reads nothing for the
        stall bound is treated as one that hung up."""
        try:
            await asyncio.wait_for(self.queue.put(event), self.stall_seconds)
        except TimeoutError:
            log.warning(
                "the client of %s read nothing for %.0f s; treating it as gone",
                self.exchange.reservation_id,
                self.stall_seconds,
            )
            self.response_ended()

    async def _close(self, outcome: Outcome) -> None:
        try:
            with contextlib.suppress(httpx.HTTPError):
                await self.upstream.aclose()
        finally:
            if self.slot is not None:
                self.slot.release()
        await self.exchange.finish(self.tracker, outcome)
        if not self.client_gone:
            with contextlib.suppress(TimeoutError):  # a stalled client gets no end marker
                await asyncio.wait_for(self.queue.put(None), self.stall_seconds)

    async def body(self) -> AsyncIterator[bytes]:
        """The response body: events as the pump forwards them."""
        try:
            while (event := await self.queue.get()) is not None:
                yield event
            self.completed = True
        finally:
            self.response_ended()

    def response_ended(self) -> None:
        """The response is over; unless it ran to its end, the client hung up:
        drain the upstream (bounded) or cancel it."""
        if self.completed or self.client_gone:
            return
        self.client_gone = True
        while not self.queue.empty():
            self.queue.get_nowait()
        task = self.pump_task
        if task is None or task.done():
            return
        # A tenant past its cap of drains has its further hang-ups cancelled:
        # abandoned streams cannot pin its share of the upstream's pool.
        if self.disconnect == "cancel" or (self.slot is not None and not self.slot.may_drain()):
            task.cancel()
        else:
            if self.slot is not None:
                self.slot.start_drain()
            if self.metrics is not None:
                self.metrics.drain_started()
            asyncio.get_running_loop().call_later(self.drain_seconds, task.cancel)


class RelayResponse(StreamingResponse):
    """A streaming response that tells its relay when it ends, even if it never began."""

    def __init__(self, relay: StreamRelay, headers: Mapping[str, str], media_type: str) -> None:
        super().__init__(relay.body(), headers=headers, media_type=media_type)
        self.relay = relay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.relay.response_ended()
