"""The wait queue's rules with a scripted decision function (no database).

The queue over a real server (order, bounds, timeouts, disconnects) is
proven in tests/faults/test_waiting.py; here, what is hard to time there:
a caller leaving while its decision is in flight, and what is never queued.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest

from llmquota.admission.releases import BackgroundReleases
from llmquota.admission.reservation import Admission
from llmquota.admission.waiting import ClientLeft, WaitQueue
from llmquota.domain.errors import InvalidRequest
from llmquota.domain.records import AdmitDecision, AdmitRequest, TenantFigures
from llmquota.metrics import Metrics

REQUEST = AdmitRequest("acme", None, "gpt-4o", 10, 90, False, None, None, None)
NO_FIGURES = TenantFigures(None, None, None, None, None, None)


def decision(status: str, **fields: Any) -> AdmitDecision:
    values: dict[str, Any] = {
        "status": status,
        "reservation_id": None,
        "reserved_tokens": 100,
        "lease_expires_at": None,
        "lease_generation": None,
        "limit_kind": None,
        "limit_scope": None,
        "retry_after_ms": None,
        "capacity": None,
        "remaining_tokens": None,
        "remaining_requests": None,
        "remaining_in_flight": None,
        "tenant": NO_FIGURES,
    }
    values.update(fields)
    return AdmitDecision(**values)


def admitted() -> AdmitDecision:
    return decision(
        "admitted",
        reservation_id=uuid.uuid4(),
        lease_expires_at=datetime.now(UTC),
        lease_generation=1,
    )


def rate_limited(retry_after_ms: int) -> AdmitDecision:
    return decision(
        "rate_limited", limit_kind="tokens", limit_scope="tenant", retry_after_ms=retry_after_ms
    )


class Script:
    """Decisions handed out in order; each can be held until the test lets it go."""

    def __init__(self, *decisions: AdmitDecision, hold: int | None = None) -> None:
        self.decisions = list(decisions)
        self.calls = 0
        # Call number `hold` (from 0) waits for `gate`; `called[n]` is set when call n starts.
        self.hold = hold
        self.gate = asyncio.Event()
        self.called = [asyncio.Event() for _ in decisions]
        self.released: list[uuid.UUID] = []

    async def decide(self, request: AdmitRequest) -> Admission:
        n = self.calls
        self.calls += 1
        self.called[n].set()
        if n == self.hold:
            await self.gate.wait()
        return Admission(self.decisions[n], request.input_tokens, False)

    async def release(self, reservation_id: uuid.UUID) -> None:
        self.released.append(reservation_id)


def queue(script: Script, metrics: Metrics, cap_ms: int = 30_000) -> tuple[WaitQueue, Any]:
    releases = BackgroundReleases(script.release)
    return WaitQueue(script.decide, releases, metrics, cap_ms=cap_ms, max_per_tenant=4), releases


async def test_an_admission_made_as_its_caller_left_is_released() -> None:
    made = admitted()
    script = Script(rate_limited(20), made, hold=1)
    metrics = Metrics()
    waits, releases = queue(script, metrics)
    left = asyncio.Event()
    task = asyncio.ensure_future(waits.decide(REQUEST, 5_000, left=left.wait()))
    await script.called[1].wait()  # refused at once, queued, decided again 20 ms later
    # The second decision is in flight; the caller leaves, then the decision admits.
    left.set()
    with pytest.raises(ClientLeft):
        await task
    assert script.released == []
    script.gate.set()
    for _ in range(10):
        await asyncio.sleep(0)  # the decision finishes; its release is scheduled
    await releases.close()

    assert script.released == [made.reservation_id]
    assert waits.waiting() == 0
    assert metrics.waiting._value.get() == 0
    assert metrics.wait_seconds.labels("left")._sum.get() > 0


async def test_a_request_that_can_never_fit_is_answered_at_once_never_queued() -> None:
    too_large = decision("too_large", limit_kind="tokens", limit_scope="tenant", capacity=50)
    script = Script(too_large)
    waits, _ = queue(script, Metrics())

    waited = await waits.decide(REQUEST, 5_000)

    assert waited.admission.decision.status == "too_large"
    assert (waited.waited_ms, script.calls, waits.waiting()) == (0, 1, 0)


async def test_a_hint_beyond_the_wait_is_answered_at_once() -> None:
    script = Script(rate_limited(2_000))
    waits, _ = queue(script, Metrics())

    waited = await waits.decide(REQUEST, 1_000)

    assert waited.admission.decision.retry_after_ms == 2_000
    assert (waited.waited_ms, script.calls) == (0, 1)


async def test_a_wait_over_the_cap_is_refused_naming_the_field() -> None:
    script = Script()
    waits, _ = queue(script, Metrics(), cap_ms=1_000)
    left = asyncio.Event()

    with pytest.raises(InvalidRequest, match=r"^max_wait_ms: at most 1000"):
        # The `left` coroutine is closed unstarted: no "never awaited" warning.
        await waits.decide(REQUEST, 1_001, left=left.wait())
    assert script.calls == 0
