"""The REST admission endpoint under a tenant's flood of refusals: each is the
same 429 the store would give, its Retry-After counted down, and after the
first they are answered from the worker's memory (admission/refusals.py)."""

from __future__ import annotations

import time

import httpx

from tests.api.conftest import make_tenant
from tests.faults.conftest import metric_value

BODY = {"tenant": "acme", "model": "gpt-4o", "input_tokens": 500, "max_tokens": 0}


async def test_a_flood_of_429s_is_answered_from_memory(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    acme = await make_tenant(client, admin, "acme", tokens_per_minute=60, token_burst=1_000)
    first = await client.post("/v1/admit", json={**BODY, "input_tokens": 900}, headers=acme)
    assert first.status_code == 201
    before = metric_value(
        (await client.get("/metrics")).text, "llmquota_refusals_from_memory_total"
    )

    started = time.monotonic()
    refusals = [await client.post("/v1/admit", json=BODY, headers=acme) for _ in range(50)]
    elapsed = time.monotonic() - started

    assert {r.status_code for r in refusals} == {429}
    hints = [r.json()["error"]["retry_after_ms"] for r in refusals]
    # 400 tokens short at one a second, counted down, never up.
    assert 399_000 <= min(hints) <= max(hints) <= 400_000, hints
    assert all(r.headers["retry-after-ms"] == str(h) for r, h in zip(refusals, hints, strict=True))
    assert all(r.json()["error"]["scope"] == "tenant" for r in refusals)
    exposition = (await client.get("/metrics")).text
    from_memory = metric_value(exposition, "llmquota_refusals_from_memory_total") - before
    # The first went to the store, and then one at most per memory window
    # (LLMQUOTA_REFUSAL_MEMORY_MS, 100 ms) the flood lasted: all but a few.
    to_store = 50 - from_memory
    assert 1 <= to_store <= 1 + elapsed / 0.1, (from_memory, elapsed)
    assert from_memory > 0, (from_memory, elapsed)

    # Settling the tenant's reservation on this worker ends the memory at once.
    settle = await client.post(
        f"/v1/reservations/{first.json()['reservation_id']}/settle",
        json={"input_tokens": 100, "output_tokens": 0},
        headers=acme,
    )
    assert settle.status_code == 200, settle.text
    assert (await client.post("/v1/admit", json=BODY, headers=acme)).status_code == 201
