"""Shared layers forget like the limits they mirror (issue 20), over real sockets.

One absurd settlement used to run a shared layer's balance down without
bound: a `low` tenant's 2-token reservation settled at 10^7 output took a
provider ceiling to -9,989,999, and a `critical` tenant then waited 27.8 h.
Now a provider ceiling and the global layer (every shard of a sharded one)
stop at minus their burst: the ledger has the usage in full, flagged in
`forgiven_tokens`, the metric `llmquota_shared_debt_forgiven_tokens_total`
counts what the shared layer did not take, and a request that fits is
admitted again once the layer refills one burst plus the request itself.

Every layer here refills 6,000 tokens a minute with a burst of 100, so one
burst takes 1 s: a request of 2 tokens waits at most 1.02 s.
"""

from __future__ import annotations

import time

import asyncpg
import httpx
import pytest

from tests.faults.conftest import fault_settings, metric_value, serving

ADMIN_KEY = "lq_test_admin_key_shared_floor_0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
ABSURD = 10_000_000
BURST = 100
TOKENS_PER_SECOND = 100  # 6,000 a minute
FORGIVEN = "llmquota_shared_debt_forgiven_tokens_total"
# A request of 2 tokens (input 1, max_tokens 1) after the layer reached -100.
WAIT_BOUND_MS = (BURST + 2) * 1_000 // TOKENS_PER_SECOND  # 1,020 ms
# What a loaded shared machine may add to a measured wait.
SCHEDULING_SLACK_S = 0.5
# The refill a settlement's own statement may add between reading a shared
# balance and writing it (10 ms at 100 tokens a second; microseconds, idle).
WRITE_REFILL_TOKENS = 1


async def _key(client: httpx.AsyncClient, tenant: str, policy: dict[str, object]) -> dict[str, str]:
    put = await client.put(f"/v1/tenants/{tenant}/policy", json=policy, headers=ADMIN)
    assert put.status_code == 200, put.text
    made = await client.post(f"/v1/tenants/{tenant}/keys", headers=ADMIN)
    assert made.status_code == 201, made.text
    return {"Authorization": f"Bearer {made.json()['key']}"}


def _admit(tenant: str, input_tokens: int, max_tokens: int, **extra: object) -> dict[str, object]:
    return {
        "tenant": tenant,
        "model": "gpt-4o",
        "input_tokens": input_tokens,
        "max_tokens": max_tokens,
        "degrade": False,
        **extra,
    }


async def _settle(
    client: httpx.AsyncClient, key: dict[str, str], reservation_id: str, output_tokens: int
) -> None:
    settled = await client.post(
        f"/v1/reservations/{reservation_id}/settle",
        json={"input_tokens": 1, "output_tokens": output_tokens},
        headers=key,
    )
    assert settled.status_code == 200, settled.text


async def _admitted_within_one_burst(
    client: httpx.AsyncClient, key: dict[str, str], tenant: str, scope: str, settled_at: float
) -> None:
    """A 2-token request is refused with a hint of at most one burst's refill
    plus its own, then admitted by waiting that long, not a day."""
    refused = await client.post("/v1/admit", json=_admit(tenant, 1, 1), headers=key)
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert (error["scope"], error["reason"]) == (scope, "capacity")
    assert 0 < error["retry_after_ms"] <= WAIT_BOUND_MS

    admitted = await client.post(
        "/v1/admit", json=_admit(tenant, 1, 1, max_wait_ms=5_000), headers=key
    )
    waited_s = time.monotonic() - settled_at
    assert admitted.status_code == 201, admitted.text
    assert int(admitted.headers["llmquota-waited-ms"]) <= WAIT_BOUND_MS + 1_000 * SCHEDULING_SLACK_S
    assert waited_s <= WAIT_BOUND_MS / 1_000 + SCHEDULING_SLACK_S


async def test_an_absurd_settlement_takes_a_ceiling_to_minus_its_burst_only(
    database_dsn: str, db: asyncpg.Connection
) -> None:
    settings = fault_settings(admin_key=ADMIN_KEY)
    async with (
        serving(settings, database_dsn) as (url, _app),
        httpx.AsyncClient(base_url=url, timeout=60) as client,
    ):
        for plan, priority in (("free", "low"), ("enterprise", "critical")):
            body = {"priority": priority, "tokens_per_minute": 1_000_000}
            assert (await client.put(f"/v1/plans/{plan}", json=body, headers=ADMIN)).is_success
        ceiling = {"models": ["gpt-4o"], "tokens_per_minute": 6_000, "token_burst": BURST}
        put = await client.put("/v1/ceilings/org-4o", json=ceiling, headers=ADMIN)
        assert put.status_code == 200, put.text
        low = await _key(client, "low", {"plan": "free"})
        critical = await _key(client, "critical", {"plan": "enterprise"})

        held = await client.post("/v1/admit", json=_admit("low", 1, 1), headers=low)
        assert held.status_code == 201, held.text
        assert held.json()["reserved_tokens"] == 2
        reservation_id = held.json()["reservation_id"]
        await _settle(client, low, reservation_id, ABSURD)
        settled_at = time.monotonic()

        # The ceiling stopped at minus its burst (the stored balance, as the
        # settlement wrote it: plus the refill of the microseconds between
        # the statement's reading of the balance and its write).
        stored = await db.fetchval("SELECT tokens FROM limit_layers WHERE scope = 'ceiling'")
        assert -BURST <= stored < -BURST + WRITE_REFILL_TOKENS
        # Billing truth: the usage in full, flagged with what the ceiling forgave.
        row = await db.fetchrow(
            "SELECT input_tokens, output_tokens, forgiven_tokens FROM usage_ledger "
            "WHERE reservation_id = $1",
            reservation_id,
        )
        assert row is not None
        assert (row["input_tokens"], row["output_tokens"]) == (1, ABSURD)
        # 10^7 + 1 used - 2 reserved - (its balance before, 98 to 100 with
        # refill, + 100 down to the floor)
        assert 9_999_799 <= row["forgiven_tokens"] <= 9_999_801
        text = (await client.get("/metrics")).text
        assert metric_value(text, FORGIVEN, scope="ceiling") == row["forgiven_tokens"]
        assert metric_value(text, FORGIVEN, scope="global") == 0
        # The tenant's own layer carries the whole debt.
        own = await db.fetchval(
            "SELECT tokens FROM limit_layers WHERE scope = 'tenant' AND tenant = 'low'"
        )
        assert own < 1_000_000 - ABSURD + 1_000

        await _admitted_within_one_burst(client, critical, "critical", "ceiling", settled_at)


@pytest.mark.parametrize("shards", [1, 4])
async def test_absurd_settlements_take_the_global_layer_to_minus_its_burst_only(
    database_dsn: str, db: asyncpg.Connection, shards: int
) -> None:
    settings = fault_settings(admin_key=ADMIN_KEY)
    async with (
        serving(settings, database_dsn) as (url, _app),
        httpx.AsyncClient(base_url=url, timeout=60) as client,
    ):
        policy = {"tokens_per_minute": 6_000, "token_burst": BURST, "shards": shards}
        put = await client.put("/v1/policies/global", json=policy, headers=ADMIN)
        assert put.status_code == 200, put.text
        greedy = await _key(client, "greedy", {"tokens_per_minute": 1_000_000})
        quiet = await _key(client, "quiet", {"tokens_per_minute": 1_000_000})

        # Five reservations of 20 (input 4, max_tokens 16) take the whole
        # burst; settled at 10^7 each, the global layer is charged the cap,
        # ceil(4 x 1.25) + 64 + 16 = 85: 65 above each reservation, 325 in
        # all, of which it can take only its balance plus the burst.
        held = []
        for _ in range(5):
            admitted = await client.post("/v1/admit", json=_admit("greedy", 4, 16), headers=greedy)
            assert admitted.status_code == 201, admitted.text
            held.append(admitted.json()["reservation_id"])
        for reservation_id in held:
            await _settle(client, greedy, reservation_id, ABSURD)
        settled_at = time.monotonic()

        rows = await db.fetch(
            "SELECT tokens, token_burst FROM limit_layers WHERE scope = 'global' ORDER BY shard"
        )
        assert len(rows) == shards
        for row in rows:  # each shard at minus its own share of the burst
            assert -row["token_burst"] <= row["tokens"] < -row["token_burst"] + WRITE_REFILL_TOKENS
        assert sum(r["token_burst"] for r in rows) == BURST
        forgiven = await db.fetch(
            "SELECT output_tokens, forgiven_tokens FROM usage_ledger "
            "WHERE reservation_id = ANY ($1::uuid[]) ORDER BY recorded_at",
            held,
        )
        assert [r["output_tokens"] for r in forgiven] == [ABSURD] * 5
        total = sum(r["forgiven_tokens"] for r in forgiven)
        # 325 - (what the layer held, at most 100 of refill during the test) - 100;
        # the first settlement (65 from about 0) never reaches the floor.
        assert 25 <= total <= 225
        assert forgiven[0]["forgiven_tokens"] == 0
        assert all(r["forgiven_tokens"] <= 65 for r in forgiven)  # never more than its debit
        # the last one entirely, but for what the layer refilled since the one before
        assert forgiven[-1]["forgiven_tokens"] >= 65 - TOKENS_PER_SECOND * SCHEDULING_SLACK_S
        text = (await client.get("/metrics")).text
        assert metric_value(text, FORGIVEN, scope="global") == total
        assert metric_value(text, FORGIVEN, scope="ceiling") == 0

        await _admitted_within_one_burst(client, quiet, "quiet", "global", settled_at)
