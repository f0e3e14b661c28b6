"""The two clocks of a worker's slices (admission/allotments.py), on a clock
the test moves: a key warms to a slice only after WARM_REQUESTS requests
within WARM_SECONDS (a tenant seen once in a while never costs a statement
of its own), and a slice left unused for IDLE_SECONDS is given back.

The tests that count admissions from slices over a real store turn both
windows off (`slices_off_the_clock`): these are the windows' own tests.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any, cast

import pytest

from llmquota.admission import allotments as module
from llmquota.admission.allotments import (
    IDLE_SECONDS,
    WARM_REQUESTS,
    WARM_SECONDS,
    Allotments,
)
from llmquota.admission.policy_cache import PolicyCache
from llmquota.config import Settings
from llmquota.domain.records import AdmitRequest
from llmquota.store.allotments import Grant, SliceKey

REQUEST = AdmitRequest("acme", None, "gpt-4o", 100, 400, False, None, None, None)


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


class SliceStore:
    """Grants every slice asked for; records what was asked and given back."""

    def __init__(self) -> None:
        self.asked: list[uuid.UUID] = []
        self.returned: list[uuid.UUID] = []

    async def allot(self, allotment_id: uuid.UUID, key: SliceKey, **ask: Any) -> Grant:
        self.asked.append(allotment_id)
        tenant = cast(Any, None)  # not read: no request is admitted from it here
        now = datetime.now(UTC)
        return Grant(
            "allotted", ask["tokens"], ask["requests"], 60, 1e6, 1e3, tenant, None, None, now
        )

    async def give_back(
        self, allotment_ids: list[uuid.UUID], *, deadline_seconds: float | None = None
    ) -> tuple[int, int]:
        self.returned += allotment_ids
        return len(allotment_ids), 0


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    moved = Clock()
    monkeypatch.setattr(module.time, "monotonic", moved)
    return moved


def worker(store: SliceStore) -> Allotments:
    settings = Settings(_env_file=None)  # type: ignore[call-arg]
    policies = PolicyCache(refresh_seconds=10, max_stale_seconds=60)
    allotments = Allotments(cast(Any, store), settings, policies, lambda _decisions: None)
    allotments.applies = lambda _request: True  # type: ignore[method-assign]
    return allotments


async def test_a_key_warms_to_a_slice_only_with_enough_requests_in_one_window(
    clock: Clock,
) -> None:
    store = SliceStore()
    allotments = worker(store)
    for _ in range(WARM_REQUESTS - 1):
        assert allotments.decide(REQUEST) is None  # decided exactly
        clock.now += 0.01
    # The window closes one request short: the count starts over.
    clock.now += WARM_SECONDS
    for _ in range(WARM_REQUESTS - 1):
        assert allotments.decide(REQUEST) is None
        clock.now += 0.01
    await allotments.background_done()
    assert store.asked == []
    # The WARM_REQUESTS-th of one window asks for a slice, in the background.
    assert allotments.decide(REQUEST) is None
    await allotments.background_done()
    assert len(store.asked) == 1
    assert allotments.slices[SliceKey("acme", None, "gpt-4o", None)].tokens > 0


async def test_a_slice_unused_for_the_idle_window_is_given_back(clock: Clock) -> None:
    store = SliceStore()
    allotments = worker(store)
    for _ in range(WARM_REQUESTS):
        allotments.decide(REQUEST)
    await allotments.background_done()
    (taken,) = store.asked

    # The check (at most once per IDLE_SECONDS, on a request of any key) finds
    # it unused for exactly the window: kept.
    clock.now += IDLE_SECONDS
    allotments.decide(REQUEST._replace(tenant="beta"))
    await allotments.background_done()
    assert store.returned == []
    assert SliceKey("acme", None, "gpt-4o", None) in allotments.slices

    # The next check finds it unused for longer: given back.
    clock.now += IDLE_SECONDS
    allotments.decide(REQUEST._replace(tenant="beta"))
    await allotments.background_done()
    assert store.returned == [taken]
    assert SliceKey("acme", None, "gpt-4o", None) not in allotments.slices
