"""No statement of an admission or a settlement reads every limit layer.

limit_layers holds a row per tenant (and route, key, ceiling), so a
statement inside lq_admit or lq_finish that scans it costs time in
proportion to the number of tenants, on every batch. The functions run
their statements with generic plans (plan_cache_mode), planned once per
session: a condition that picks its column at run time (a CASE in a WHERE)
cannot use an index in such a plan. lq_shared_forgiven had one, and each
settlement batch read all of limit_layers once for the global layer: 0.75 ms
at 10,000 tenants (BENCHMARKS.md, issue 25, seventh part).

Here a batch of 64 admissions is settled as lq_finish is called, with every
plan of every statement inside logged (auto_explain, nested statements), in a
session that plans with `enable_seqscan` off: the planner then takes an
index wherever one can serve the condition (at a few thousand tenants a scan
may rightly be cheaper; at many more it is not), so a sequential scan left
in a plan is one that no index could avoid. Every table that grows with the
tenants or the traffic is checked.
"""

from __future__ import annotations

import asyncpg

from llmquota.admin.alerts import AlertService
from llmquota.admission.limiter import Limiter
from llmquota.domain.plans import Ceiling
from llmquota.domain.policy import Policy
from llmquota.domain.quotas import QuotaSpec

TENANTS = 500
BATCH = 64
# Tables that grow with tenants, routes, keys and traffic.
GROWING = ("limit_layers", "reservations", "usage_ledger", "output_estimates", "tenants", "quotas")


async def plans_of(db: asyncpg.Connection, sql: str) -> list[str]:
    """The plan of every statement `sql` runs, nested ones included."""
    plans: list[str] = []

    def heard(_connection: object, message: asyncpg.PostgresLogMessage) -> None:
        plans.append(message.message)

    db.add_log_listener(heard)
    try:
        await db.execute("LOAD 'auto_explain'")
        await db.execute(
            "SET auto_explain.log_min_duration = 0; SET auto_explain.log_nested_statements = on;"
            " SET auto_explain.log_level = notice; SET client_min_messages = notice"
        )
        await db.fetch(sql)
    finally:
        await db.execute("SET auto_explain.log_min_duration = -1")
        db.remove_log_listener(heard)
    return [p for p in plans if "Query Text:" in p]


def scanning(plans: list[str]) -> str:
    """The plans that scan a growing table from end to end ('' for none)."""
    scans = [f"Seq Scan on {table}" for table in GROWING]
    return "\n\n".join(p for p in plans if any(scan in p for scan in scans))


def batch_admission(tenants: list[str], keys: list[str] | None) -> str:
    """lq_admit for `tenants` (gpt-4o, 300 in, 2,000 out), with idempotency keys."""
    n, names = len(tenants), ", ".join(f"'{t}'" for t in tenants)
    given = (
        f"ARRAY[{', '.join(repr(k) for k in keys)}]"
        if keys
        else f"array_fill(NULL::text, ARRAY[{n}])"
    )
    return f"""lq_admit(ARRAY[{names}], array_fill(NULL::text, ARRAY[{n}]),
                   array_fill('gpt-4o'::text, ARRAY[{n}]), array_fill(300::bigint, ARRAY[{n}]),
                   array_fill(2000::bigint, ARRAY[{n}]), array_fill(false, ARRAY[{n}]),
                   array_fill(NULL::integer, ARRAY[{n}]), {given},
                   array_fill(NULL::text, ARRAY[{n}]), 1000)"""


def settled(admission: str) -> str:
    """`admission`, and each reservation it admits settled (250 in, 900 out, ok)."""
    n = "cardinality(ids.ids)"
    return f"""SELECT count(*)
                 FROM (SELECT ARRAY(SELECT a.reservation_id FROM {admission} AS a) AS ids) AS ids,
                      lq_finish(ids.ids, array_fill('settle'::text, ARRAY[{n}]),
                                array_fill(NULL::text, ARRAY[{n}]),
                                array_fill(250::bigint, ARRAY[{n}]),
                                array_fill(900::bigint, ARRAY[{n}]),
                                array_fill('ok'::text, ARRAY[{n}]))"""


def some_tenants() -> list[str]:
    return [f"t{1 + i * 31 % TENANTS}" for i in range(BATCH)]


async def test_admitting_and_settling_a_batch_reads_every_growing_table_by_index(
    db: asyncpg.Connection,
) -> None:
    """A batch of the fast path (no ceiling, quota or idempotency key)."""
    # Before any plan of this session is made (they are cached, generic).
    await db.execute("SET enable_seqscan = off")
    await db.execute(
        """INSERT INTO limit_layers (scope, tokens_per_minute, token_burst, tokens)
           VALUES ('global', 10000000000, 10000000000, 10000000000)"""
    )
    await db.execute(
        "INSERT INTO tenants (tenant) SELECT 't' || g FROM generate_series(1, $1::int) AS g",
        TENANTS,
    )
    await db.execute(
        """INSERT INTO limit_layers (scope, tenant, tokens_per_minute, token_burst, tokens)
           SELECT 'tenant', 't' || g, 1000000, 1000000, 1000000
             FROM generate_series(1, $1::int) AS g""",
        TENANTS,
    )
    await db.execute("ANALYZE")
    for _ in range(2):  # the session's plans made, as a worker's connection has them
        await db.execute(settled(batch_admission(some_tenants(), None)))
    plans = await plans_of(db, settled(batch_admission(some_tenants(), None)))
    assert len(plans) >= 20  # lq_admit's and lq_finish's statements, each planned
    assert any("Insert on usage_ledger" in p for p in plans)  # the settlement's
    assert scanning(plans) == ""
    assert await db.fetchval("SELECT count(*) FROM usage_ledger") == 3 * BATCH


async def test_the_exact_loop_and_the_sweep_read_every_growing_table_by_index(
    db: asyncpg.Connection, limiter: Limiter
) -> None:
    """With a ceiling, quotas and idempotency keys a batch takes lq_admit_decide's
    steps, not the fast path; the sweeper expires what outlived its lease."""
    await db.execute("SET enable_seqscan = off")
    await limiter.store.put_policy("global", None, None, _policy(10**10))
    for i in range(1, TENANTS + 1):
        await limiter.store.put_policy("tenant", f"t{i}", None, _policy(10**6))
    await limiter.store.catalog.put_ceiling(
        "gpt", Ceiling(models=["gpt-4o*"], tokens_per_minute=10**9, token_burst=10**9, shed=[])
    )
    alerts = AlertService(limiter.store, deadline_seconds=30.0)
    for i in range(1, TENANTS + 1, 7):
        await alerts.put_quota(f"t{i}", None, "daily", QuotaSpec(period="day", tokens=10**8))
    await db.execute("ANALYZE")
    for round_ in range(2):
        keys = [f"k{round_}-{i}" for i in range(BATCH)]
        await db.execute(settled(batch_admission(some_tenants(), keys)))
    keys = [f"k-read-{i}" for i in range(BATCH)]
    plans = await plans_of(db, settled(batch_admission(some_tenants(), keys)))
    text = "\n".join(plans)
    # lq_admit_decide's steps ran: keys locked, ceilings matched, quota windows read.
    assert "lq_lock_idempotency_keys" in text and "lq_model_ceiling" in text
    assert "quota_windows" in text
    # The sweeper expires 8 admitted with their lease made to have run out.
    await db.fetch(f"SELECT * FROM {batch_admission(some_tenants()[:8], None)}")
    await db.execute(
        "UPDATE reservations SET lease_expires_at = now() - interval '1 s' WHERE state = 'active'"
    )
    plans += await plans_of(db, "SELECT * FROM lq_sweep(100)")
    assert scanning(plans) == ""
    assert await db.fetchval("SELECT count(*) FROM usage_ledger WHERE outcome = 'expired'") == 8


def _policy(tokens: int) -> Policy:
    return Policy(tokens_per_minute=tokens, token_burst=tokens)
