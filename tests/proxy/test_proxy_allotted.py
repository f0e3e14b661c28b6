"""Allotted admission on the proxy, through the official SDK (issue 25): a
tenant whose policy says `"admission": "allotted"` has its completions
admitted from slices, and each is settled with the provider's usage and
billed exactly once, as `/v1/admit`'s are."""

from __future__ import annotations

import asyncpg
import pytest

from llmquota.admission.allotments import WARM_REQUESTS
from tests.proxy.conftest import Stack, settled

# Counted admissions from slices mean the count, not the warm-up's clock.
pytestmark = pytest.mark.usefixtures("slices_off_the_clock")

MESSAGES = [{"role": "user", "content": "hello"}]
CALLS = WARM_REQUESTS + 16


async def test_completions_of_an_allotted_tenant_come_from_slices_and_bill_once(
    stack: Stack, db: asyncpg.Connection
) -> None:
    policy = {"tokens_per_minute": 10_000_000, "admission": "allotted"}
    assert (await stack.admin.put("/v1/tenants/acme/policy", json=policy)).is_success
    await completions_come_from_slices_and_bill_once(stack, db)


async def test_a_plans_allotted_admission_reaches_its_tenants_completions(
    stack: Stack, db: asyncpg.Connection
) -> None:
    plan = {"tokens_per_minute": 10_000_000, "admission": "allotted"}
    assert (await stack.admin.put("/v1/plans/fast", json=plan)).is_success
    put = await stack.admin.put("/v1/tenants/acme/policy", json={"plan": "fast"})
    assert put.status_code == 200, put.text
    await completions_come_from_slices_and_bill_once(stack, db)


async def completions_come_from_slices_and_bill_once(stack: Stack, db: asyncpg.Connection) -> None:
    """CALLS completions of acme through the SDK: those after the warm-up come from
    slices, each is settled with the provider's usage and has one ledger row."""
    client = stack.openai()
    for _ in range(WARM_REQUESTS):
        await client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=5)
    await stack.app.state.limiter.allotments.background_done()  # the slice, taken meanwhile
    for _ in range(CALLS - WARM_REQUESTS):
        done = await client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=5)
        assert done.choices[0].message.content
        await stack.app.state.limiter.allotments.background_done()  # a top-up, off the clock
    rows = await settled(db, CALLS)
    assert len(rows) == CALLS
    assert len({r["reservation_id"] for r in rows}) == CALLS  # one ledger row each
    assert all(r["outcome"] == "ok" and r["output_tokens"] > 0 for r in rows)
    from_slices = await db.fetchval(
        "SELECT count(*) FROM reservations WHERE allotment_id IS NOT NULL"
    )
    assert from_slices == CALLS - WARM_REQUESTS, f"{from_slices} of {CALLS} from slices"
    # Each journaled with the deployment it went to, as lq_admit journals it.
    upstreams = await db.fetch(
        "SELECT DISTINCT upstream, allotment_id IS NOT NULL AS sliced FROM reservations"
    )
    assert {r["sliced"] for r in upstreams} == {True, False}
    (upstream,) = {r["upstream"] for r in upstreams}
    assert upstream is not None, upstreams
