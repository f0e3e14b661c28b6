"""Weighted request cost while the store is away (issue 24): the sibling of lq_admit.

A worker in failure mode `local` decides from its cached policies what one
call counts as exactly as lq_admit would (the route's request_cost and
uses_concurrency, else the tenant's), takes that locally, and the replay
records the same weight on the store's rows, so the books agree afterwards.
"""

from __future__ import annotations

import asyncpg
import pytest

from llmquota.admission.limiter import Limiter
from llmquota.domain.errors import RateLimited
from tests.conftest import audit_findings
from tests.faults.conftest import count, fault_settings, layer, put
from tests.faults.proxy import PgProxy
from tests.faults.test_outage import wait_until_recorded


async def test_local_mode_takes_each_calls_weight_and_the_replay_records_it(
    proxy: PgProxy, db: asyncpg.Connection, owner_dsn: str
) -> None:
    limiter = await Limiter.connect(proxy.dsn, fault_settings(outage_local_fraction=0.5))
    try:
        # 40 requests of capacity (1 a minute) and 4 permits; locally 20 and 2.
        await put(
            limiter,
            "tenant",
            "acme",
            requests_per_minute=1,
            request_burst=40,
            max_in_flight=4,
            failure_mode="local",
        )
        await put(limiter, "route", "acme", "export", request_cost=6, failure_mode="local")
        await put(limiter, "route", "acme", "meta", uses_concurrency=False, failure_mode="local")
        await limiter.refresh_policies()
        await proxy.cut()

        exports = [
            await limiter.admit(
                tenant="acme", route="export", model="m", input_tokens=1, max_tokens=1
            )
            for _ in range(2)
        ]  # 12 of the local 20 requests, both local permits
        with pytest.raises(RateLimited) as refused:
            await limiter.admit(tenant="acme", model="m", input_tokens=1, max_tokens=1)
        assert (refused.value.limit, refused.value.scope) == ("concurrency", "tenant")
        # a call without concurrency still passes, for one request each
        metas = [
            await limiter.admit(
                tenant="acme", route="meta", model="m", input_tokens=1, max_tokens=1
            )
            for _ in range(8)
        ]
        with pytest.raises(RateLimited) as refused:
            await limiter.admit(
                tenant="acme", route="meta", model="m", input_tokens=1, max_tokens=1
            )
        assert (refused.value.limit, refused.value.scope) == ("requests", "tenant")
        await exports[0].release()  # its 6 requests and its permit come back locally
        exports.append(
            await limiter.admit(
                tenant="acme", route="export", model="m", input_tokens=1, max_tokens=1
            )
        )

        await proxy.restore()
        await wait_until_recorded(limiter)
        assert await count(db, "reservations", "outage_mode = 'local'") == 2 + 8 + 1
        row = await layer(db, "acme")
        # recorded at their weight: 2 live exports (12) + 8 metas (8) + the
        # released export, which gave its 6 back
        assert float(row["requests"]) == pytest.approx(40 - 20, abs=0.1)
        assert row["in_flight"] == 2
        for held in exports[1:] + metas:
            await held.settle(input_tokens=1, output_tokens=1)
        assert (await layer(db, "acme"))["in_flight"] == 0
        assert await audit_findings(owner_dsn) == []
    finally:
        await limiter.close()
