"""ETags across workers: two `llmquota serve` processes on one database, over real HTTP.

The ETag is the row's policy_version, read from the database, so both workers
show the same tag for the same policy; and the If-Match check is in the write's
statement, so two PATCHes carrying one ETag through two different workers at
once still end in exactly one 200 and one 412.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from tests.faults.conftest import serving_process

ADMIN_KEY = "lq_etags_admin_key_0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
MERGE = {"content-type": "application/merge-patch+json"}
ROUNDS = 5


async def test_both_workers_show_one_etag_and_one_of_two_concurrent_patches_wins(
    database_dsn: str, tmp_path: Path
) -> None:
    async with (
        serving_process(database_dsn, ADMIN_KEY, tmp_path / "a.log") as base_a,
        serving_process(database_dsn, ADMIN_KEY, tmp_path / "b.log") as base_b,
        httpx.AsyncClient(base_url=base_a, timeout=30, headers=ADMIN) as a,
        httpx.AsyncClient(base_url=base_b, timeout=30, headers=ADMIN) as b,
    ):
        put = await a.put("/v1/tenants/acme/policy", json={"tokens_per_minute": 6_000})
        assert put.status_code == 200, put.text
        etag = put.headers["etag"]
        assert (await b.get("/v1/tenants/acme/policy")).headers["etag"] == etag
        for round_ in range(ROUNDS):
            answers = await asyncio.gather(
                a.patch(
                    "/v1/tenants/acme/policy",
                    json={"max_in_flight": 2 * round_ + 1},
                    headers={**MERGE, "if-match": etag},
                ),
                b.patch(
                    "/v1/tenants/acme/policy",
                    json={"max_in_flight": 2 * round_ + 2},
                    headers={**MERGE, "if-match": etag},
                ),
            )
            assert sorted(r.status_code for r in answers) == [200, 412], [r.text for r in answers]
            winner = next(r for r in answers if r.status_code == 200)
            seen_a = await a.get("/v1/tenants/acme/policy")
            seen_b = await b.get("/v1/tenants/acme/policy")
            assert seen_a.headers["etag"] == seen_b.headers["etag"] == winner.headers["etag"]
            assert seen_a.json()["max_in_flight"] == winner.json()["max_in_flight"]
            assert seen_a.json()["tokens_per_minute"] == 6_000
            etag = winner.headers["etag"]
