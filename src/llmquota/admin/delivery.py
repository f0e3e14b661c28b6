"""The webhook delivery loop: claim due deliveries, POST them signed, record each attempt.

It runs in `llmquota serve` (the app's lifespan) and in `llmquota sweep
--loop`, in any number of processes at once: a claim locks its rows with
FOR UPDATE SKIP LOCKED and moves them a lease ahead (claim_deliveries in
sql/alerts_queries.sql), so two loops never send the same delivery at the
same time. A loop killed between its POST and its record leaves the
delivery to become due again when its lease passes: the receiver may then
see the event a second time, with the same `llmquota-event-id`, and drops it.

Destinations are independent: each delivery is a task of its own, at most
`per_destination` of one webhook are in flight in a loop (the claim itself
leaves a busy webhook's other rows for later), and the loop claims again as
soon as a slot frees, never waiting for a batch to finish. So one receiver
that answers slowly (each attempt bounded by the sender to the timeout)
holds a few slots, and every other webhook's alerts go out beside it.

HTTP is not this layer's (import-linter): the adapter that starts the loop
injects `send`, a callable that POSTs bytes with headers and says what came
back. Every failure of a receiver is recorded and retried with exponential
backoff and jitter (domain.alerts.retry_delay_seconds) for up to a day.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from llmquota.domain.alerts import (
    Delivery,
    SendResult,
    encode_body,
    retry_delay_seconds,
    signature,
)
from llmquota.domain.errors import StoreUnavailable
from llmquota.metrics import Metrics
from llmquota.store.alerts import AlertStore

log = logging.getLogger("llmquota.alerts")

# POST url, body, headers, timeout in seconds -> what the receiver answered.
Sender = Callable[[str, bytes, Mapping[str, str], float], Awaitable[SendResult]]

EVENT_ID_HEADER = "llmquota-event-id"
SIGNATURE_HEADER = "llmquota-signature"
# A recorded error is cut to this many characters.
MAX_ERROR_CHARS = 500


@dataclass(frozen=True, slots=True)
class DeliveryLimits:
    """How much one loop does at once and how long it waits."""

    batch_size: int = 50
    claim_seconds: float = 60.0
    timeout_seconds: float = 10.0
    interval_seconds: float = 1.0
    per_destination: int = 4


class DeliveryLoop:
    """Delivers the alert outbox to the webhooks, at least once and signed."""

    def __init__(
        self,
        store: AlertStore,
        send: Sender,
        limits: DeliveryLimits | None = None,
        metrics: Metrics | None = None,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        self._store = store
        self._send = send
        self._limits = limits or DeliveryLimits()
        self._metrics = metrics or Metrics()
        self._jitter = jitter
        self._sending: set[asyncio.Task[None]] = set()
        self._in_flight: dict[str, int] = {}
        self._slot_freed = asyncio.Event()

    async def run_once(self) -> int:
        """Claim what is due (within the per-destination cap) and send it; wait for
        those sends; how many were claimed."""
        started = await self._claim_and_start()
        if started:
            await asyncio.gather(*started)
        return len(started)

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Deliver until `stop` is set (or the task is cancelled), outliving outages."""
        stop = stop or asyncio.Event()
        try:
            while not stop.is_set():
                try:
                    started = await self._claim_and_start()
                except StoreUnavailable as exc:
                    log.warning("alert delivery: database unavailable, retrying: %s", exc)
                    started = []
                if started and len(self._sending) < self._limits.batch_size:
                    continue  # more may be due: claim again at once
                # Wait for a slot to free, for stop, or for the interval.
                self._slot_freed.clear()
                waits = [asyncio.ensure_future(stop.wait())]
                if self._sending:
                    waits.append(asyncio.ensure_future(self._slot_freed.wait()))
                try:
                    await asyncio.wait(
                        waits,
                        timeout=self._limits.interval_seconds,
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                finally:
                    for wait in waits:
                        wait.cancel()
        finally:
            # Sends in flight finish (each bounded by the timeout) or, when the
            # loop itself is cancelled, are cancelled: unrecorded, sent again later.
            pending = list(self._sending)
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)

    async def _claim_and_start(self) -> list[asyncio.Task[None]]:
        free = self._limits.batch_size - len(self._sending)
        if free <= 0:
            return []
        claimed = await self._store.claim_deliveries(
            free,
            self._limits.claim_seconds,
            self._limits.per_destination,
            {hook: count for hook, count in self._in_flight.items() if count > 0},
        )
        started = []
        for delivery in claimed:
            self._in_flight[delivery.webhook] = self._in_flight.get(delivery.webhook, 0) + 1
            task = asyncio.create_task(self._deliver(delivery), name="llmquota-alert-send")
            self._sending.add(task)
            task.add_done_callback(functools.partial(self._sent, delivery.webhook))
            started.append(task)
        return started

    def _sent(self, webhook: str, task: asyncio.Task[None]) -> None:
        self._sending.discard(task)
        left = self._in_flight.get(webhook, 1) - 1
        if left > 0:
            self._in_flight[webhook] = left
        else:
            self._in_flight.pop(webhook, None)
        self._slot_freed.set()

    async def _deliver(self, delivery: Delivery) -> None:
        body = encode_body(delivery.event)
        headers = {
            "content-type": "application/json",
            EVENT_ID_HEADER: str(delivery.event.event_id),
            SIGNATURE_HEADER: signature(delivery.secret, int(time.time()), body),
            "user-agent": "llmquota-webhooks",
        }
        started = time.monotonic()
        try:
            result = await self._send(delivery.url, body, headers, self._limits.timeout_seconds)
        except Exception as exc:  # a sender bug must not stop the loop: record it, retry
            result = SendResult(delivered=False, error=f"{type(exc).__name__}: {exc}")
        duration_ms = int((time.monotonic() - started) * 1000)
        retry = None
        if not result.delivered:
            retry = retry_delay_seconds(delivery.attempt, delivery.age_seconds, self._jitter())
        outcome = "delivered" if result.delivered else ("retry" if retry is not None else "gave_up")
        self._metrics.alerts.labels(delivery.event.event_type, outcome).inc()
        try:
            await self._store.record_delivery(
                delivery,
                delivered=result.delivered,
                status=result.status,
                error=None if result.error is None else result.error[:MAX_ERROR_CHARS],
                retry_seconds=retry,
                duration_ms=duration_ms,
            )
        except StoreUnavailable as exc:
            # Unrecorded: the claim's lease runs out and the delivery is sent again.
            log.warning("alert delivery %s not recorded: %s", delivery.event.event_id, exc)
