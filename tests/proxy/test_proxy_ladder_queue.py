"""A ceiling's queue step in proxy mode (issue 23), through the official openai SDK.

The ladder's `queue_ms` holds a proxy request its step sheds until room
frees, with no header from the client: the answer says how long it waited
(`llmquota-waited-ms`) and counts as serving path `queued`.
"""

from __future__ import annotations

import asyncio

import asyncpg

from llmquota.admission.limiter import Limiter
from tests.proxy.conftest import Stack, settled
from tests.proxy.test_proxy_metrics import scrape, value
from tests.support import queued

MESSAGES = [{"role": "user", "content": "hello"}]
BURST = 10_000


async def test_a_proxy_request_the_ladder_sheds_waits_for_room_and_is_served(
    stack: Stack, db: asyncpg.Connection
) -> None:
    ceiling = {
        "models": ["gpt-4o"],
        "tokens_per_minute": 1,  # no refill worth a request within the test
        "token_burst": BURST,
        "shed": [{"above": 0.5, "admit": ["critical"], "queue_ms": 5_000}],
    }
    assert (await stack.admin.put("/v1/ceilings/provider", json=ceiling)).is_success
    limiter: Limiter = stack.app.state.limiter
    await limiter.refresh_policies()
    # Another caller holds 50% of the ceiling through /v1/admit.
    body = {"tenant": "acme", "model": "gpt-4o", "input_tokens": 1, "max_tokens": 4_999}
    held = await stack.admin.post("/v1/admit", json=body)
    assert held.status_code == 201, held.text
    client = stack.openai()
    call = asyncio.ensure_future(
        client.chat.completions.with_raw_response.create(
            model="gpt-4o", messages=MESSAGES, max_tokens=1_000
        )
    )
    await queued(limiter, "acme")
    await asyncio.sleep(0.2)
    assert not call.done(), "the shed request waits in the ceiling's queue"
    assert stack.fake.requests == []  # nothing went upstream meanwhile
    rid = held.json()["reservation_id"]
    assert (await stack.admin.post(f"/v1/reservations/{rid}/release")).is_success
    raw = await call
    assert raw.status_code == 200
    assert int(raw.headers["llmquota-waited-ms"]) >= 200
    assert raw.parse().choices[0].message.content
    assert len(stack.fake.requests) == 1
    (row,) = await settled(db, 1)
    assert row["model"] == "gpt-4o"
    samples = await scrape(stack)
    assert value(samples, "llmquota_serving_path_total", path="queued") == 1
    assert value(samples, "llmquota_serving_path_total", path="rejected") == 0
