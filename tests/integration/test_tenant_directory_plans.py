"""The tenant directory's page finds each tenant's latest reservation by index.

With a few thousand reservations, EXPLAIN of list_tenants must show the
last-activity lookup as a probe of reservations_tenant_created (migration
0019), never a scan of reservations, and the page itself as a keyset walk of
the tenants' primary key (no OFFSET).
"""

from __future__ import annotations

import asyncpg

from llmquota.store.sqlfiles import queries

TENANTS = 500
RESERVATIONS_EACH = 10


async def test_last_activity_uses_the_index(db: asyncpg.Connection) -> None:
    await db.execute(
        "INSERT INTO tenants SELECT 't' || lpad(g::text, 4, '0') "
        f"FROM generate_series(1, {TENANTS}) AS g"
    )
    await db.execute(
        "INSERT INTO limit_layers (scope, tenant) SELECT 'tenant', tenant FROM tenants"
    )
    await db.execute(
        f"""INSERT INTO reservations (reservation_id, tenant, model, layer_ids, input_tokens,
                                      input_estimated, max_tokens, reserved_tokens,
                                      policy_version, lease_seconds, created_at,
                                      lease_expires_at, state, finished_at)
            SELECT gen_random_uuid(), t.tenant, 'gpt-4o', '{{}}', 1, false, 1, 2, 1, 60,
                   now() - make_interval(secs => r), now(), 'settled', now()
              FROM tenants AS t, generate_series(1, {RESERVATIONS_EACH}) AS r"""
    )
    await db.execute("ANALYZE")
    assert await db.fetchval("SELECT count(*) FROM reservations") == TENANTS * RESERVATIONS_EACH
    lines = await db.fetch("EXPLAIN " + queries()["list_tenants"], "t0100", 101, None)
    plan = "\n".join(line[0] for line in lines)
    assert "reservations_tenant_created" in plan, plan
    assert "Seq Scan on reservations" not in plan, plan
    statement = "\n".join(
        line for line in queries()["list_tenants"].splitlines() if not line.startswith("--")
    )
    assert "OFFSET" not in statement.upper()
    rows = await db.fetch(queries()["list_tenants"], "t0100", 3, None)
    assert [r["tenant"] for r in rows] == ["t0101", "t0102", "t0103"]
    newest = await db.fetchval("SELECT max(created_at) FROM reservations WHERE tenant = 't0101'")
    assert rows[0]["last_activity_at"] == newest
    # The rows were made for the planner only (no admission, no ledger): gone before
    # the audit of the books that follows every test.
    await db.execute("DELETE FROM reservations")
