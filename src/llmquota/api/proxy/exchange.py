"""One proxied request's reservation, from admission to its one settlement.

Whatever happens to the request (an answer, a provider error, a client that
hangs up, a drain cut short, a shutdown), its reservation is finished exactly
once: released when the provider produced nothing, else settled with the
provider's own usage or, where the provider never reported it, with the
output counted so far by tiktoken. The UsageTracker reads both wire formats'
usage as it passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from llmquota.admission.limiter import Limiter
from llmquota.admission.reservation import Admission
from llmquota.api.proxy.wire import Kind, usage_of
from llmquota.domain.errors import LimiterError
from llmquota.domain.tokens import count_text
from llmquota.domain.vocabulary import Outcome

log = logging.getLogger(__name__)

# The shortest pause between heartbeats, whatever the lease.
MIN_HEARTBEAT_SECONDS = 0.1


class UsageTracker:
    """The provider's reported usage and the text produced, from JSON events or bodies."""

    def __init__(self, kind: Kind) -> None:
        self.kind = kind
        self.input_tokens: int | None = None
        self.output_tokens: int | None = None
        self.text: list[str] = []
        self.failed = False
        # Whether the final figures arrived (a body's usage, OpenAI's usage
        # chunk, Anthropic's message_delta), not only message_start's.
        self.final = False

    def record_usage(self, usage: object) -> None:
        """Keep the latest figures the provider reported (Anthropic's are cumulative)."""
        input_tokens, output_tokens = usage_of(self.kind, usage)
        if input_tokens is not None:
            self.input_tokens = input_tokens
        if output_tokens is not None:
            self.output_tokens = output_tokens

    def read_body(self, body: object) -> None:
        """Read a whole (non-streamed) answer: its usage, and its text in case it has none."""
        if not isinstance(body, Mapping):
            return
        if isinstance(body.get("usage"), Mapping):
            self.record_usage(body["usage"])
            self.final = True
        for choice in body.get("choices") or ():  # OpenAI
            if not isinstance(choice, Mapping):
                continue
            message = choice.get("message")
            if isinstance(message, Mapping) and isinstance(message.get("content"), str):
                self.text.append(message["content"])
            elif isinstance(choice.get("text"), str):
                self.text.append(choice["text"])
        for block in body.get("content") or ():  # Anthropic
            if isinstance(block, Mapping) and isinstance(block.get("text"), str):
                self.text.append(block["text"])

    def observe(self, event: object) -> bool:
        """Read one stream event; True if it is OpenAI's usage-only chunk."""
        if not isinstance(event, Mapping):
            return False
        if self.kind == "openai":
            return self._observe_openai(event)
        self._observe_anthropic(event)
        return False

    def _observe_openai(self, chunk: Mapping[str, Any]) -> bool:
        if chunk.get("error") is not None:
            self.failed = True
        choices = chunk.get("choices")
        for choice in choices if isinstance(choices, list) else ():
            if isinstance(choice, Mapping) and isinstance(choice.get("text"), str):
                self.text.append(choice["text"])  # the legacy completions endpoint
            delta = choice.get("delta") if isinstance(choice, Mapping) else None
            if not isinstance(delta, Mapping):
                continue
            if isinstance(delta.get("content"), str):
                self.text.append(delta["content"])
            for call in delta.get("tool_calls") or ():
                function = call.get("function") if isinstance(call, Mapping) else None
                if isinstance(function, Mapping) and isinstance(function.get("arguments"), str):
                    self.text.append(function["arguments"])
        if isinstance(chunk.get("usage"), Mapping):
            self.record_usage(chunk["usage"])
            self.final = True
            return choices == []
        return False

    def _observe_anthropic(self, event: Mapping[str, Any]) -> None:
        kind = event.get("type")
        if kind == "message_start" and isinstance(event.get("message"), Mapping):
            self.record_usage(event["message"].get("usage"))
        elif kind == "message_delta":
            self.record_usage(event.get("usage"))
            self.final = True
        elif kind == "content_block_delta" and isinstance(event.get("delta"), Mapping):
            delta = event["delta"]
            for field in ("text", "partial_json", "thinking"):
                if isinstance(delta.get(field), str):
                    self.text.append(delta[field])
        elif kind == "error":
            self.failed = True

    def produced(self) -> bool:
        """Whether the provider produced any output (or reported any)."""
        return any(self.text) or (self.final and bool(self.output_tokens))


class Exchange:
    """The reservation of one proxied request; finished exactly once."""

    def __init__(
        self,
        limiter: Limiter,
        tenant: str,
        model: str,
        admission: Admission,
        estimate_factors: Mapping[str, float],
    ) -> None:
        decision = admission.decision
        assert decision.reservation_id is not None
        self.limiter = limiter
        self.tenant = tenant
        self.model = model
        self.reservation_id: uuid.UUID = decision.reservation_id
        self.lease_generation = decision.lease_generation
        self.counted_input = admission.input_tokens
        self.decision = decision
        self.fallback = admission.fallback  # admitted by a failure mode during an outage
        self.estimate_factors = estimate_factors
        self.finished = False
        # A stream's pump owns the reservation from the moment it starts.
        self.handed_over = False

    async def release(self) -> None:
        """The provider was not called, or charged nothing: give everything back."""
        if self.finished:
            return
        self.finished = True
        try:
            await self.limiter.release(self.reservation_id, caller=self.tenant)
        except LimiterError as exc:
            log.warning("could not release reservation %s: %s", self.reservation_id, exc)

    async def finish(self, tracker: UsageTracker, outcome: Outcome) -> None:
        """Settle what the provider produced, or release if it produced nothing."""
        if self.finished:
            return
        if outcome != "ok" and not tracker.produced():
            await self.release()
            return
        self.finished = True
        output = tracker.output_tokens if tracker.final else None
        if outcome != "ok" or output is None:
            text = "".join(tracker.text)
            counted = count_text(text, self.model, self.estimate_factors).tokens if text else 0
            output = max(output or 0, counted)
        input_tokens = tracker.input_tokens
        if input_tokens is None:
            input_tokens = self.counted_input
        try:
            await self.limiter.settle(
                self.reservation_id,
                input_tokens=input_tokens,
                output_tokens=output,
                outcome=outcome,
                caller=self.tenant,
            )
        except LimiterError as exc:
            # The lease will expire and the sweeper records it; nothing is lost twice.
            log.warning("could not settle reservation %s: %s", self.reservation_id, exc)

    async def keep_alive(self, every_seconds: float) -> None:
        """Renew the lease until cancelled (a long stream must not lose its reservation).

        Every `every_seconds`, or a third of the lease when a policy's lease is
        shorter than that.
        """
        expires_at = self.decision.lease_expires_at
        while True:
            interval = every_seconds
            if expires_at is not None:
                left = (expires_at - datetime.now(UTC)).total_seconds()
                interval = min(every_seconds, max(MIN_HEARTBEAT_SECONDS, left / 3))
            await asyncio.sleep(interval)
            with contextlib.suppress(LimiterError):
                result = await self.limiter.heartbeat(
                    self.reservation_id,
                    caller=self.tenant,
                    lease_generation=self.lease_generation,
                )
                self.lease_generation = result.lease_generation or self.lease_generation
                expires_at = result.lease_expires_at or expires_at
