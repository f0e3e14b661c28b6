"""The plans PostgreSQL really uses inside the admission functions.

auto_explain reports the plan of every statement nested in lq_admit and
lq_finish as they run: this asserts what the database does, not what the SQL
says. With 10,000 tenants, a batch of 256 distinct tenants must find and lock
its layers by index probes; a sequential scan of limit_layers (what custom
plans chose before the functions were pinned to generic plans) fails here.
"""

from __future__ import annotations

import asyncpg

from llmquota.store.sqlfiles import queries

TENANT_COUNT = 10_000
BATCH = 256
LAYER_INDEX = "limit_layers_key"


async def seed(db: asyncpg.Connection) -> None:
    await db.execute(
        """INSERT INTO limit_layers (scope, tokens_per_minute, token_burst, tokens)
           VALUES ('global', 1000000000, 1000000000, 1000000000)"""
    )
    await db.execute(
        f"INSERT INTO tenants SELECT 't' || g FROM generate_series(1, {TENANT_COUNT}) AS g"
    )
    await db.execute(
        f"""INSERT INTO limit_layers (scope, tenant, tokens_per_minute, token_burst, tokens)
            SELECT 'tenant', 't' || g, 1000000, 1000000, 1000000
              FROM generate_series(1, {TENANT_COUNT}) AS g"""
    )
    await db.execute(
        """INSERT INTO limit_layers (scope, tenant, route, max_in_flight)
           SELECT 'route', 't' || g, 'chat', 100 FROM generate_series(1, 1000) AS g"""
    )
    await db.execute("ANALYZE")


async def nested_plans(db: asyncpg.Connection, statement: str, *args: object) -> list[str]:
    """Run `statement`; return the plans auto_explain reported for it and its nested statements."""
    plans: list[str] = []

    def listener(_connection: object, message: asyncpg.PostgresLogMessage) -> None:
        if message.message.startswith("duration"):
            plans.append(message.message)

    await db.execute(
        """LOAD 'auto_explain';
           SET auto_explain.log_min_duration = 0;
           SET auto_explain.log_nested_statements = on;
           SET auto_explain.log_level = notice;
           SET client_min_messages = notice"""
    )
    db.add_log_listener(listener)
    try:
        await db.fetch(statement, *args)
    finally:
        db.remove_log_listener(listener)
        await db.execute("RESET client_min_messages; SET auto_explain.log_min_duration = -1")
    return plans


def plan_of(plans: list[str], marker: str) -> str:
    found = [p for p in plans if marker in p]
    assert len(found) == 1, f"{len(found)} plans mention {marker!r}"
    return found[0]


async def test_a_batch_of_distinct_tenants_locks_its_layers_by_index_probes(
    db: asyncpg.Connection,
) -> None:
    await seed(db)
    # A provider ceiling for another model: the default-list and ceiling
    # lookups run (they are skipped without any ceiling), and match nothing,
    # so the batch still takes the set-based fast path.
    await db.execute(
        """INSERT INTO limit_layers (scope, ceiling, models, model_patterns)
           VALUES ('ceiling', 'other', ARRAY['claude-*'], ARRAY['claude-%'])"""
    )
    tenants = [f"t{g}" for g in range(1, BATCH * 30, 30)]
    n = len(tenants)
    plans = await nested_plans(
        db,
        queries()["admit"],
        tenants,
        ["chat"] * n,
        ["gpt-4o"] * n,
        [100] * n,
        [100] * n,
        [False] * n,
        [None] * n,
        [None] * n,
        [None] * n,
        1000,
        *([None] * 9),  # priorities, degradation, output reserve, deadline, ids: none
        # each request's API key (none of them has limits): probed by index too
        list(range(1, n + 1)),
        None,  # fallbacks' output reserves: none
        None,  # serving paths: none (primary)
        *([None] * 4),  # deployments: none named
    )

    # The fast path finds and locks them in one statement (a bitmap of probes).
    lookup = plan_of(plans, "FROM limit_layers AS ll")
    assert any(
        f"{scan} {LAYER_INDEX}" in lookup
        for scan in ("Index Scan using", "Index Only Scan using", "Bitmap Index Scan on")
    ), lookup
    assert "Seq Scan on limit_layers" not in lookup
    # The default fallback lists of the batch's tenants and routes: probes too.
    defaults = plan_of(plans, "JOIN limit_layers AS d")
    assert "Seq Scan on limit_layers" not in defaults, defaults
    # The fast path's one statement debits every layer by primary key.
    persist = plan_of(plans, "UPDATE limit_layers AS ll")
    assert "Index Scan using limit_layers_pkey" in persist
    assert "Seq Scan on limit_layers" not in persist
    admitted = await db.fetchval("SELECT count(*) FROM reservations")
    assert admitted == BATCH


async def test_settling_a_batch_finds_reservations_and_layers_by_index(
    db: asyncpg.Connection,
) -> None:
    await seed(db)
    tenants = [f"t{g}" for g in range(1, BATCH + 1)]
    n = len(tenants)
    admitted = await db.fetch(
        queries()["admit"],
        tenants,
        [None] * n,
        ["gpt-4o"] * n,
        [100] * n,
        [100] * n,
        [False] * n,
        [None] * n,
        [None] * n,
        [None] * n,
        1000,
        # priorities, degradation, output reserve, deadline, ids, keys, fallbacks' output,
        # serving paths, deployments: none
        *([None] * 16),
    )
    # Ten thousand finished reservations around them, so a scan would show.
    await db.execute(
        """INSERT INTO reservations (reservation_id, tenant, model, layer_ids, input_tokens,
                                     input_estimated, max_tokens, reserved_tokens,
                                     policy_version, state, lease_seconds, created_at,
                                     lease_expires_at, finished_at)
           SELECT gen_random_uuid(), 't1', 'm', '{1}', 1, false, 1, 2, 1, 'released', 60,
                  now(), now(), now()
             FROM generate_series(1, 10000)"""
    )
    await db.execute("ANALYZE reservations")
    ids = [row["reservation_id"] for row in admitted]
    plans = await nested_plans(
        db,
        queries()["finish"],
        ids,
        ["settle"] * n,
        [None] * n,
        [50] * n,
        [20] * n,
        ["ok"] * n,
        ["reported"] * n,
        [None] * n,
        [None] * n,
        [None] * n,  # serving paths: the journaled ones
    )

    lock = plan_of(plans, "FROM reservations AS rs\n      WHERE rs.reservation_id = ANY")
    assert "reservations_pkey" in lock and "Seq Scan on reservations" not in lock
    credit = plan_of(plans, "UPDATE limit_layers AS l")
    assert "limit_layers_pkey" in credit and "Seq Scan on limit_layers" not in credit
    assert await db.fetchval("SELECT count(*) FROM usage_ledger") == BATCH
