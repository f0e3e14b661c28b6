"""A known tenant's key whose row changes keeps its tenant's fair-share lane.

Found by CI (the verdicts corner of tests/api/test_grid_corners.py refused 32
of 4,001 requests with room left): the announcement of a key's own creation
reached the worker while its first request was being answered, so the worker
forgot the key, and the next 100 concurrent requests queued as a stranger's
in the unknown keys' lane (UNKNOWN_KEY_MAX_IN_PROGRESS 4 + UNKNOWN_KEY_MAX_WAITING
64): 32 were refused with 429. A key the worker knew is looked up again in its
tenant's lane (32 in progress, 256 queued), one lookup for all of them.

The same lane met a new key's first burst on a worker that had not seen it
(one that just started, after every deploy): it now takes one place per key.
"""

from __future__ import annotations

import asyncio

import httpx
from fastapi import FastAPI

from llmquota.api.auth import Authenticator
from llmquota.domain.keys import key_digest
from tests.api.conftest import make_tenant
from tests.support import announcements_applied

BODY = {"tenant": "acme", "model": "gpt-4o", "input_tokens": 10, "max_tokens": 10}
BURST = 100


async def test_a_burst_after_the_keys_row_changed_is_served_in_its_tenants_lane(
    served: tuple[httpx.AsyncClient, FastAPI], admin: dict[str, str], app_dsn: str
) -> None:
    client, app = served
    headers = await make_tenant(client, admin, "acme", tokens_per_minute=1_000_000)
    await announcements_applied(app, app_dsn)  # the key's creation, before its first use
    assert (await client.post("/v1/admit", json=BODY, headers=headers)).status_code == 201
    authenticator: Authenticator = app.state.authenticator
    lookups_before = _first_lookups(app)
    # The database's announcement that the key's row changed, as the listener delivers it.
    secret = headers["Authorization"].removeprefix("Bearer ")
    authenticator.key_changed(key_digest(secret))
    answers = await asyncio.gather(
        *(client.post("/v1/admit", json=BODY, headers=headers) for _ in range(BURST))
    )
    statuses = [a.status_code for a in answers]
    assert statuses.count(201) == BURST, {s: statuses.count(s) for s in set(statuses)}
    assert _first_lookups(app) - lookups_before == 1  # one lookup for the whole burst


async def test_a_new_keys_first_burst_on_a_cold_worker_is_served_whole_with_one_lookup(
    served: tuple[httpx.AsyncClient, FastAPI], admin: dict[str, str], app_dsn: str
) -> None:
    """A worker just started (or a key just made) knows nothing of the key: its
    first 200 requests at once would meet the unknown keys' lane, 4 served and
    64 queued, and 132 were refused with 429 before the lane took one place per
    key. Now the first looks the key up and the others wait for it."""
    client, app = served
    headers = await make_tenant(client, admin, "acme", tokens_per_minute=10_000_000)
    await announcements_applied(app, app_dsn)
    lookups_before = _first_lookups(app)
    answers = await asyncio.gather(
        *(client.post("/v1/admit", json=BODY, headers=headers) for _ in range(2 * BURST))
    )
    statuses = [a.status_code for a in answers]
    assert statuses.count(201) == 2 * BURST, {s: statuses.count(s) for s in set(statuses)}
    assert _first_lookups(app) - lookups_before == 1


def _first_lookups(app: FastAPI) -> float:
    registry = app.state.limiter.metrics.registry
    value = registry.get_sample_value(
        "llmquota_key_lookups_total", {"purpose": "first", "result": "found"}
    )
    return value or 0.0
