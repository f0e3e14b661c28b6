"""One proxied request's reservation, from admission to its one settlement.

Whatever happens to the request (an answer, a provider error, a client that
hangs up, a drain cut short, a shutdown), its reservation is finished exactly
once: released when the provider produced nothing, else settled. The
reservation is the library's own handle (admission/reservation.py), so the
settlement rules live in one place; what is the proxy's is turning what the
provider said into figures. The UsageTracker keeps the provider's usage as it
passes (in both wire formats, as reported: a figure can be absurd, a string
or missing) and the text produced; domain/upstream_usage.py resolves them
into what to settle: reported, clamped at the settle limit, or counted with
tiktoken on the relayed text. Usage is never dropped: a settle the store
does not answer is journaled and replayed when it is back, and a stream that
lost its lease still settles (late).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from llmquota.admission.reservation import Reservation
from llmquota.api.proxy.wire import Kind, usage_of
from llmquota.domain.errors import LimiterError, ReservationConflict, StoreUnavailable
from llmquota.domain.records import AdmitDecision
from llmquota.domain.tokens import count_text
from llmquota.domain.upstream_usage import UpstreamUsage, resolve_usage
from llmquota.domain.vocabulary import FailureMode, Outcome, SettledPath

log = logging.getLogger(__name__)

# The shortest pause between heartbeats, whatever the lease.
MIN_HEARTBEAT_SECONDS = 0.1


class UsageTracker:
    """The provider's reported usage and the text produced, from JSON events or bodies."""

    def __init__(self, kind: Kind) -> None:
        self.kind = kind
        # As the provider reported them (None: not reported): anything JSON holds.
        self.reported_input: object = None
        self.reported_output: object = None
        self.text: list[str] = []
        self.failed = False
        # Whether the final figures arrived (a body's usage, OpenAI's usage
        # chunk, Anthropic's message_delta), not only message_start's.
        self.final = False

    @property
    def output_tokens(self) -> int | None:
        """The output the provider reported, if it is a plain figure (for metrics)."""
        value = self.reported_output
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
        return None

    def record_usage(self, usage: object) -> None:
        """Keep the latest figures the provider reported (Anthropic's are cumulative)."""
        input_tokens, output_tokens = usage_of(self.kind, usage)
        if input_tokens is not None:
            self.reported_input = input_tokens
        if output_tokens is not None:
            self.reported_output = output_tokens

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

    def usage(
        self,
        counted_input: int,
        model: str,
        estimate_factors: Mapping[str, float],
        outcome: Outcome,
    ) -> UpstreamUsage:
        """What to settle: the provider's final figures where usable, else our count.

        Only final figures count as reported (Anthropic's message_start says
        1 output token); an answer cut short settles at least what was relayed.
        """

        def count_output() -> int:
            text = "".join(self.text)
            return count_text(text, model, estimate_factors).tokens if text else 0

        return resolve_usage(
            self.reported_input,
            self.reported_output if self.final else None,
            counted_input=counted_input,
            count_output=count_output,
            complete=outcome == "ok",
        )


class Exchange:
    """The reservation of one proxied request; finished exactly once."""

    def __init__(
        self, reservation: Reservation, model: str, estimate_factors: Mapping[str, float]
    ) -> None:
        self.reservation = reservation
        self.model = model
        self.estimate_factors = estimate_factors
        self.finished = False
        # How the request is being served, for its ledger row, when the proxy
        # knows better than the admission did: routes.py sets
        # second_deployment when a deployment after the first serves it. None:
        # as the reservation journaled it (fallback_model, queued), else primary.
        self.serving_path: SettledPath | None = None
        # A stream's pump owns the reservation from the moment it starts.
        self.handed_over = False
        # Set at the first relayed output: the next heartbeat goes at once and says so.
        self._relayed = asyncio.Event()

    @property
    def reservation_id(self) -> uuid.UUID:
        return self.reservation.reservation_id

    @property
    def decision(self) -> AdmitDecision:
        return self.reservation.decision

    @property
    def fallback(self) -> FailureMode | None:
        """The failure mode that admitted it during an outage, if one did."""
        return self.reservation.fallback

    async def release(self) -> None:
        """The provider was not called, or charged nothing: give everything back."""
        if self.finished:
            return
        self.finished = True
        try:
            await self.reservation.release()
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
        usage = tracker.usage(
            self.reservation.input_tokens, self.model, self.estimate_factors, outcome
        )
        if usage.source != "reported":
            log.warning(
                "upstream usage of %s was not usable as reported (input %.40r, output %.40r): "
                "settled %d + %d tokens, %s",
                self.reservation_id,
                tracker.reported_input,
                tracker.reported_output,
                usage.input_tokens,
                usage.output_tokens,
                usage.source,
            )
        try:
            settlement = await self.reservation.settle_upstream(
                usage, outcome, serving_path=self.serving_path
            )
        except LimiterError as exc:
            # Journaling failed too (a full journal), or the store refused it:
            # the lease expires with nothing, and the audit flags a relayed one.
            log.error("could not settle reservation %s: %s", self.reservation_id, exc)
            return
        if settlement.late:
            log.warning(
                "reservation %s settled late (its lease ran out); usage recorded",
                self.reservation_id,
            )

    def relayed(self) -> None:
        """Output reached the client: the store is told with the next heartbeat, at once."""
        self._relayed.set()

    async def keep_alive(self, every_seconds: float) -> None:
        """Renew the lease until cancelled (a long stream must not lose its reservation).

        Every `every_seconds`, or a third of the lease when a policy's lease is
        shorter than that; and once at the first relayed output, which marks
        the reservation as relayed for the audit. A failed heartbeat is
        logged and tried again; a lost lease (expired, or taken over) ends the
        heartbeats, and the stream's settlement still records the usage (late).
        """
        marked = failed = False
        while True:
            expires_at = self.reservation.lease_expires_at
            left = (expires_at - datetime.now(UTC)).total_seconds()
            interval = min(every_seconds, max(MIN_HEARTBEAT_SECONDS, left / 3))
            if marked or failed:
                await asyncio.sleep(interval)
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._relayed.wait(), interval)
            relayed = self._relayed.is_set() and not marked
            try:
                await self.reservation.heartbeat(relayed=relayed)
            except StoreUnavailable as exc:
                log.warning("heartbeat of %s failed, will retry: %s", self.reservation_id, exc)
                failed = True
                continue
            except ReservationConflict as exc:
                if exc.state in ("settled", "released"):
                    return  # the stream ended while this heartbeat was on its way
                log.warning(
                    "reservation %s lost its lease (%s); the stream goes on and "
                    "its settlement will be recorded late",
                    self.reservation_id,
                    exc,
                )
                return
            except LimiterError as exc:
                log.warning("heartbeat of %s refused: %s", self.reservation_id, exc)
                return
            marked, failed = marked or relayed, False
