"""Allotted admission while the store is away (issue 25).

A slice is a real debit of its layers, taken before the store went away:
what it still holds is decided from as before, whatever the failure mode,
and what was admitted from it is journaled once the store answers again.
When the slice runs dry the exact path answers, by the layer's failure
mode (`closed` here: 503). The books hold afterwards: what the layer holds,
plus what slices hold, plus what active reservations hold, is the capacity.
"""

from __future__ import annotations

import asyncpg
import pytest

from llmquota.admission.allotments import WARM_REQUESTS
from llmquota.admission.limiter import Limiter
from llmquota.domain.errors import StoreUnavailable
from tests.faults.conftest import count, fault_settings, put
from tests.faults.proxy import PgProxy

# Counted admissions from slices mean the count, not the warm-up's clock.
pytestmark = pytest.mark.usefixtures("slices_off_the_clock")

BURST = 1_000_000
COST = 100 + 400


async def admit(limiter: Limiter) -> None:
    await limiter.admit(tenant="acme", model="gpt-4o", input_tokens=100, max_tokens=400)


async def test_a_slice_keeps_deciding_while_the_store_is_away_and_is_journaled_after(
    proxy: PgProxy, db: asyncpg.Connection
) -> None:
    limiter = await Limiter.connect(proxy.dsn, fault_settings())
    try:
        await put(
            limiter, "tenant", "acme", tokens_per_minute=1, token_burst=BURST, admission="allotted"
        )
        await limiter.refresh_policies()
        for _ in range(WARM_REQUESTS):
            await admit(limiter)
        await limiter.allotments.background_done()
        await limiter.allotments.write_journal()
        held = limiter.allotments.slices
        assert len(held) == 1
        in_slice = next(iter(held.values())).requests
        assert in_slice >= 1

        await proxy.cut()
        admitted = 0
        with pytest.raises(StoreUnavailable):
            for _ in range(in_slice + 1):
                await admit(limiter)
                admitted += 1
        # Every request the slice held, then the exact path's closed answer.
        assert admitted == in_slice
        with pytest.raises(StoreUnavailable):
            await limiter.allotments.write_journal()

        await proxy.restore()
        await limiter.allotments.write_journal()
        assert await count(db, "reservations") == WARM_REQUESTS + admitted
        assert await count(db, "reservations", "allotment_id IS NOT NULL") == admitted
    finally:
        await limiter.close()
    layer = await db.fetchval(
        "SELECT lq_refilled(tokens, tokens_per_minute, token_burst, refilled_at,"
        " clock_timestamp()) FROM limit_layers WHERE tenant = 'acme'"
    )
    active = await db.fetchval(
        "SELECT sum(reserved_tokens) FROM reservations WHERE state = 'active'"
    )
    assert await count(db, "allotments") == 0
    assert BURST <= float(layer) + float(active) <= BURST + 60
