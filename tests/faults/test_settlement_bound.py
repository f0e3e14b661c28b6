"""One settlement cannot drain what every tenant shares.

Usage above the request's possible maximum (its counted input with a
tolerance, plus max_tokens: lq_shared_charge_cap) is charged in full to the
tenant's own layers and recorded in full in the ledger, flagged as
excess_tokens; the global layer is charged the maximum only, and never
below minus its burst (test_shared_floor.py has the floor over sockets).
"""

from __future__ import annotations

import math
import uuid

import asyncpg
import pytest

from llmquota.admission.limiter import Limiter
from llmquota.domain.records import AdmitRequest, OutageAdmissionRecord
from tests.faults.conftest import put
from tests.integration.support import status, tokens

ABSURD = 10_000_000


def _cap(input_tokens: int, max_tokens: int) -> int:
    """lq_shared_charge_cap, as documented."""
    return math.ceil(input_tokens * 1.25) + 64 + max_tokens


async def test_an_absurd_settlement_leaves_other_tenants_untouched(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    # One token a minute: what the global layer holds is what it was charged.
    await put(limiter, "global", tokens_per_minute=1, token_burst=1_000)
    await put(limiter, "tenant", "greedy", tokens_per_minute=100_000)
    await put(limiter, "tenant", "quiet", tokens_per_minute=100_000)

    held = await limiter.admit(tenant="greedy", model="m", input_tokens=1, max_tokens=1)
    settlement = await held.settle(input_tokens=ABSURD, output_tokens=ABSURD)

    cap = _cap(1, 1)
    assert settlement.charged_tokens == 2 * ABSURD
    assert settlement.excess_tokens == 2 * ABSURD - cap
    # The global layer paid exactly the cap: the 2 reserved, then cap - 2 at
    # settlement (not the reservation alone: 998; not the usage: the floor).
    global_layer = await status(limiter, "greedy", "global")
    assert global_layer.tokens == pytest.approx(1_000 - cap, abs=0.05)
    # The tenant's own layer carries the whole debt.
    greedy = await status(limiter, "greedy")
    assert greedy.tokens is not None and greedy.tokens < 100_000 - 2 * ABSURD + 1_000
    # Another tenant is admitted as if nothing happened.
    other = await limiter.admit(tenant="quiet", model="m", input_tokens=100, max_tokens=500)
    assert other.reserved_tokens == 600
    # Billing truth: the ledger has the full figures, flagged.
    row = await db.fetchrow(
        "SELECT input_tokens, output_tokens, excess_tokens FROM usage_ledger "
        "WHERE reservation_id = $1",
        held.reservation_id,
    )
    assert row is not None
    assert (row["input_tokens"], row["output_tokens"]) == (ABSURD, ABSURD)
    assert row["excess_tokens"] == 2 * ABSURD - cap
    assert limiter.metrics.excess_settlements._value.get() == 1
    assert limiter.metrics.excess_tokens._value.get() == 2 * ABSURD - cap


async def test_usage_within_the_tolerance_is_charged_everywhere_and_not_flagged(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    # A refill of one token a second: what the layers hold is what was charged.
    await put(limiter, "global", tokens_per_minute=60, token_burst=100_000)
    await put(limiter, "tenant", "fair", tokens_per_minute=60, token_burst=100_000)
    held = await limiter.admit(tenant="fair", model="m", input_tokens=1_000, max_tokens=500)
    # The provider counted 20% more input than we did, and all of max_tokens.
    settlement = await held.settle(input_tokens=1_200, output_tokens=500)
    assert settlement.excess_tokens == 0
    global_layer = await status(limiter, "fair", "global")
    tenant_layer = await status(limiter, "fair")
    assert global_layer.tokens is not None and tenant_layer.tokens is not None
    # Both layers were charged the full 1,700 (give or take refill).
    assert abs(global_layer.tokens - tenant_layer.tokens) < 5
    assert global_layer.tokens < 100_000 - 1_700 + 30
    excess = await db.fetchval(
        "SELECT excess_tokens FROM usage_ledger WHERE reservation_id = $1", held.reservation_id
    )
    assert excess == 0


async def test_a_late_absurd_settlement_is_bounded_on_shared_layers_too(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await put(limiter, "global", tokens_per_minute=1_000, token_burst=1_000)
    await put(limiter, "tenant", "late", tokens_per_minute=100_000, lease_seconds=1)
    held = await limiter.admit(tenant="late", model="m", input_tokens=10, max_tokens=10)
    await db.execute(
        "UPDATE reservations SET lease_expires_at = clock_timestamp() - interval '1 second' "
        "WHERE reservation_id = $1",
        held.reservation_id,
    )
    settlement = await held.settle(input_tokens=ABSURD, output_tokens=0)
    assert settlement.late
    assert settlement.excess_tokens == ABSURD - _cap(10, 10)
    global_layer = await status(limiter, "late", "global")
    assert global_layer.tokens is not None
    assert global_layer.tokens >= 1_000 - _cap(10, 10)


async def test_admissions_recorded_after_an_outage_take_the_global_layer_to_its_floor_only(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    # Work admitted on its own by a worker during an outage is debited when
    # the store is back, with no limit check: a shared layer still stops at
    # minus its burst; the tenant's own layer takes it all.
    await put(limiter, "global", tokens_per_minute=1, token_burst=1_000)
    await put(limiter, "tenant", "busy", tokens_per_minute=1, token_burst=100_000)
    version = await db.fetchval("SELECT policy_version FROM limit_layers WHERE tenant = 'busy'")
    records = [
        OutageAdmissionRecord(
            uuid.uuid4(),
            AdmitRequest("busy", None, "m", 600, 0, False, None, None, None),
            int(version),
            "open",
        )
        for _ in range(5)
    ]

    assert await limiter.store.outage.record_admissions(records) == [True] * 5

    # 1,000 - 5 x 600 = -2,000 without the floor
    stored = await db.fetchval("SELECT tokens FROM limit_layers WHERE scope = 'global'")
    assert stored == -1_000
    assert await tokens(limiter, "busy") == pytest.approx(100_000 - 3_000, abs=0.05)
