"""The If-Match check and the write are one statement: no read-then-write race.

Two connections run the same guarded write with the same expected version.
The first holds its transaction open after writing; the second's statement
waits on the row lock the check takes, then sees the new version and writes
nothing. A check made by a separate read before the write would have passed
for both.
"""

from __future__ import annotations

import asyncio
import json

import asyncpg

from llmquota.store.sqlfiles import queries


async def test_the_second_guarded_write_with_the_same_version_waits_then_fails(
    db: asyncpg.Connection, owner_dsn: str
) -> None:
    sql = queries()["put_tenant_policy"]
    first = await db.fetchrow(sql, "acme", None, json.dumps({"tokens_per_minute": 100}), None)
    assert first is not None and first["precondition_met"] is True
    version = str(first["policy_version"])
    other = await asyncpg.connect(owner_dsn)
    try:
        async with db.transaction():
            won = await db.fetchrow(sql, "acme", None, json.dumps({"max_in_flight": 1}), [version])
            assert won is not None and won["precondition_met"] is True
            loser = asyncio.ensure_future(
                other.fetchrow(sql, "acme", None, json.dumps({"max_in_flight": 2}), [version])
            )
            await asyncio.sleep(0.3)
            assert not loser.done()  # waiting on the row lock the check took
        lost = await asyncio.wait_for(loser, 10)
        assert lost is not None
        assert lost["precondition_met"] is False
        assert lost["policy_version"] is None
    finally:
        await other.close()
    row = await db.fetchrow(
        "SELECT max_in_flight, policy_version FROM limit_layers WHERE tenant = 'acme'"
    )
    assert row is not None
    assert row["max_in_flight"] == 1
    assert row["policy_version"] == won["policy_version"]
