"""A queue step in the shedding ladder (issue 23): shed requests wait for room.

A ceiling's ladder step may say `queue_ms`: a request the step in force
sheds waits up to that long, in the ceiling's queue (priority, then
arrival), instead of an immediate 429. Refill is one token a minute, so
room comes back only from a release, which the head of the queue sees at
its next try (at least every SHED_POLL_SECONDS).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from llmquota.admission.limiter import Limiter
from llmquota.domain.errors import RateLimited
from llmquota.domain.plans import Ceiling, Plan, ShedStep
from tests.api.conftest import ADMIN_KEY
from tests.support import queued

BURST = 10_000
SLOW = 1  # tokens a minute: no refill worth a request within a test
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


async def put(client: httpx.AsyncClient, path: str, body: Any) -> Any:
    response = await client.put(path, json=body, headers=ADMIN)
    assert response.status_code == 200, response.text
    return response.json()


async def lay_out(served: tuple[httpx.AsyncClient, FastAPI], shed: list[dict[str, Any]]) -> None:
    """The ceiling over model m with `shed`, and tenant acme on a critical plan (so it
    may ask for any priority below), known to the worker's ladder cache."""
    client, app = served
    ceiling = {"models": ["m"], "tokens_per_minute": SLOW, "token_burst": BURST, "shed": shed}
    await put(client, "/v1/ceilings/provider", ceiling)
    await put(client, "/v1/plans/top", {"priority": "critical", "max_in_flight": 100})
    await put(client, "/v1/tenants/acme/policy", {"plan": "top"})
    limiter: Limiter = app.state.limiter
    await limiter.refresh_policies()
    assert limiter.policies.ladder_of("provider"), "the queueing ladder reached the worker"


async def admit(client: httpx.AsyncClient, tokens: int, priority: str = "normal") -> httpx.Response:
    body = {"tenant": "acme", "model": "m", "input_tokens": 1, "max_tokens": tokens - 1}
    return await client.post("/v1/admit", json={**body, "priority": priority}, headers=ADMIN)


async def release(client: httpx.AsyncClient, held: httpx.Response) -> None:
    rid = held.json()["reservation_id"]
    response = await client.post(f"/v1/reservations/{rid}/release", headers=ADMIN)
    assert response.status_code == 200, response.text


QUEUED_HALF = [{"above": 0.5, "admit": ["critical"], "queue_ms": 4_000}]


async def test_a_shed_request_waits_and_is_admitted_when_room_frees(
    served: tuple[httpx.AsyncClient, FastAPI],
) -> None:
    client, app = served
    await lay_out(served, QUEUED_HALF)
    first = await admit(client, 5_000)  # the ceiling at 50%
    assert first.status_code == 201, first.text
    started = time.monotonic()
    waiting = asyncio.ensure_future(admit(client, 1_000))  # would take it to 60%: shed
    await queued(app.state.limiter, "acme")
    await asyncio.sleep(0.3)
    assert not waiting.done(), "the shed request waits instead of a 429"
    await release(client, first)
    second = await waiting
    elapsed = time.monotonic() - started
    assert second.status_code == 201, second.text
    waited = int(second.headers["llmquota-waited-ms"])
    assert 300 <= waited < 4_000 and elapsed < 4.0, (waited, elapsed)
    assert second.json()["remaining"]["tokens"] == pytest.approx(BURST - 1_000, abs=1)


async def test_a_shed_request_is_refused_once_its_queue_time_runs_out(
    served: tuple[httpx.AsyncClient, FastAPI],
) -> None:
    client, _app = served
    await lay_out(served, [{"above": 0.5, "admit": ["critical"], "queue_ms": 600}])
    assert (await admit(client, 5_000)).status_code == 201
    started = time.monotonic()
    refused = await admit(client, 1_000)
    elapsed = time.monotonic() - started
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert (error["scope"], error["reason"]) == ("ceiling", "shed")
    assert 0.55 <= elapsed < 3.0, elapsed
    assert int(refused.headers["llmquota-waited-ms"]) >= 550


async def test_above_a_step_without_queue_ms_the_429_comes_at_once(
    served: tuple[httpx.AsyncClient, FastAPI],
) -> None:
    """80% queues, 95% does not: a request taking the ceiling past 95% is refused now."""
    client, _app = served
    shed = [
        {"above": 0.8, "admit": ["critical"], "queue_ms": 4_000},
        {"above": 0.95, "admit": ["critical"]},
    ]
    await lay_out(served, shed)
    assert (await admit(client, 8_000)).status_code == 201
    started = time.monotonic()
    refused = await admit(client, 1_600)  # to 96%: the 95% step is in force
    assert refused.status_code == 429 and time.monotonic() - started < 1.0
    assert "llmquota-waited-ms" not in refused.headers
    # A smaller request (to 90%) is shed by the 80% step only: it waits.
    started = time.monotonic()
    waited = await admit(client, 1_000)
    assert waited.status_code == 429 and time.monotonic() - started >= 3.9


async def test_the_queue_admits_the_higher_priority_first_whatever_the_arrival(
    served: tuple[httpx.AsyncClient, FastAPI],
) -> None:
    client, app = served
    await lay_out(served, [{"above": 0.5, "admit": ["critical"], "queue_ms": 3_000}])
    first = await admit(client, 5_000)
    assert first.status_code == 201
    low = asyncio.ensure_future(admit(client, 4_000, "low"))
    await queued(app.state.limiter, "acme")
    high = asyncio.ensure_future(admit(client, 4_000, "high"))
    await queued(app.state.limiter, "acme", 2)
    # Room for one of them only: 5,000 back takes the ceiling to 0%; one 4,000
    # takes it to 40%, the second would take it to 80%, past the step.
    await release(client, first)
    high_answer = await high
    assert high_answer.status_code == 201, high_answer.text
    low_answer = await low
    assert low_answer.status_code == 429, low_answer.text
    assert int(low_answer.headers["llmquota-waited-ms"]) >= 2_900


async def test_a_library_caller_waits_in_the_queue_too(limiter: Limiter) -> None:
    catalog = limiter.store.catalog
    step = ShedStep(above=0.5, admit=["critical"], queue_ms=2_000)
    ceiling = Ceiling(models=["m"], tokens_per_minute=SLOW, token_burst=BURST, shed=[step])
    await catalog.put_ceiling("provider", ceiling)
    await catalog.put_plan("top", Plan(priority="critical", max_in_flight=100))
    assert await catalog.put_tenant_policy("acme", "top", {}) is not None
    await limiter.refresh_policies()
    first = await limiter.admit(tenant="acme", model="m", input_tokens=1, max_tokens=4_999)
    waiting = asyncio.ensure_future(
        limiter.admit(tenant="acme", model="m", input_tokens=1, max_tokens=999, priority="low")
    )
    await queued(limiter, "acme")
    assert not waiting.done()
    await first.release()
    second = await waiting
    assert second.reserved_tokens == 1_000
    await second.release()
    # Without room, the wait ends in the shed refusal.
    first = await limiter.admit(tenant="acme", model="m", input_tokens=1, max_tokens=4_999)
    started = time.monotonic()
    with pytest.raises(RateLimited) as refused:
        await limiter.admit(
            tenant="acme", model="m", input_tokens=1, max_tokens=999, priority="low"
        )
    assert time.monotonic() - started >= 1.9
    assert (refused.value.scope, refused.value.limit) == ("ceiling", "tokens")


async def test_queue_ms_round_trips_and_bad_values_are_422_changing_nothing(
    served: tuple[httpx.AsyncClient, FastAPI],
) -> None:
    client, _app = served
    await lay_out(served, QUEUED_HALF)
    before = await client.get("/v1/ceilings/provider", headers=ADMIN)
    got = before.json()
    assert got["shed"][0]["queue_ms"] == 4_000
    for bad in (0, -1, 600_001, 1.5, "100", True):
        body = {"models": ["m"], "tokens_per_minute": SLOW, "token_burst": BURST}
        body["shed"] = [{"above": 0.5, "admit": ["critical"], "queue_ms": bad}]
        response = await client.put("/v1/ceilings/provider", json=body, headers=ADMIN)
        assert response.status_code == 422, (bad, response.text)
        assert "queue_ms" in response.text
    after = await client.get("/v1/ceilings/provider", headers=ADMIN)
    assert after.json()["shed"] == got["shed"]
    assert after.headers["etag"] == before.headers["etag"]
