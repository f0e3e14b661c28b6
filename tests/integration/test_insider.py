"""Issue 20: the ledger against an insider holding the service's own role.

Each attack the issue reports is tried as llmquota_app (or the read-only
llmquota_reporting role): it is refused with a permission error, changes
nothing, and the billing export afterwards still numbers every row, once,
with no gap.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import asyncpg
import pytest

from llmquota.admission.limiter import Limiter
from llmquota.domain.errors import InvalidRequest, StoreUnavailable
from llmquota.finance.ledger import MAX_ADJUSTMENT_TOKENS, LedgerStore
from llmquota.store.connection import translate_errors

# A settled request's figures: 5 in, 7 out.
SETTLED_TOKENS = 12


@pytest.fixture
async def app_connection(app_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    """A plain connection as llmquota_app: what an insider with the app's
    credentials can type, beyond what the service does."""
    connection = await asyncpg.connect(app_dsn)
    yield connection
    await connection.close()


@pytest.fixture
async def reporting_connection(reporting_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    connection = await asyncpg.connect(reporting_dsn)
    yield connection
    await connection.close()


async def _one_settled(limiter: Limiter) -> None:
    await limiter.store.ensure_tenant("acme")
    reservation = await limiter.admit(
        tenant="acme", model="gpt-4o", input_tokens=5, max_tokens=50, lease_seconds=600
    )
    await reservation.settle(input_tokens=5, output_tokens=7)


# Each statement the issue used (and two more), as the app role. The hidden row: an xact_id
# below the export's cursor; the duplicate: an entry_id already numbered; the
# back-dated one: a recorded_at in a closed month.
APP_ATTACKS = (
    "INSERT INTO usage_ledger (entry_kind, tenant, input_tokens, output_tokens,"
    " reserved_tokens, outcome, reservation_id, xact_id)"
    " VALUES ('usage', 'acme', 1000000, 0, 0, 'ok', gen_random_uuid(), '1')",
    "INSERT INTO usage_ledger (entry_id, entry_kind, tenant, input_tokens, output_tokens,"
    " reserved_tokens, outcome, reason) OVERRIDING SYSTEM VALUE"
    " VALUES (1, 'adjustment', 'acme', 0, 5, 0, 'adjustment', 'dup')",
    "INSERT INTO usage_ledger (entry_kind, tenant, input_tokens, output_tokens,"
    " reserved_tokens, outcome, reason, recorded_at)"
    " VALUES ('adjustment', 'acme', 0, -7, 0, 'adjustment', 'hide', '2020-01-01')",
    "INSERT INTO credit_ledger (tenant, entry_kind, amount, balance_after, reference)"
    " VALUES ('acme', 'topup', 1000, 1000, 'free money')",
    "UPDATE ledger_export_state SET last_xact_id = '999999999', last_entry_id = 999999",
    "INSERT INTO ledger_export_positions VALUES (2, 999, now(), '1')",
    "INSERT INTO model_prices (model, effective_from, input_usd_per_million,"
    " output_usd_per_million) VALUES ('gpt-4o', '2000-01-01', 0, 0)",
    "UPDATE model_prices SET input_usd_per_million = 0",
    "SELECT setval('usage_ledger_entry_id_seq', 1)",
    "SELECT nextval('credit_ledger_entry_id_seq')",
)


async def test_the_app_role_cannot_write_a_ledger_row_itself(
    limiter: Limiter,
    app_connection: asyncpg.Connection,
    db: asyncpg.Connection,
) -> None:
    await _one_settled(limiter)
    store = LedgerStore(app_connection)
    first = [e async for e in store.export(0, limit=None, page_rows=10, number_limit=10)]
    assert [e.export_id for e in first] == [1]
    before = await db.fetchrow(
        "SELECT (SELECT count(*) FROM usage_ledger) AS ledger,"
        " (SELECT count(*) FROM credit_ledger) AS credits,"
        " (SELECT count(*) FROM ledger_export_positions) AS positions,"
        " (SELECT count(*) FROM model_prices) AS prices,"
        " (SELECT row(s.*)::text FROM ledger_export_state AS s) AS cursor"
    )

    for statement in APP_ATTACKS:
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await app_connection.execute(statement)

    after = await db.fetchrow(
        "SELECT (SELECT count(*) FROM usage_ledger) AS ledger,"
        " (SELECT count(*) FROM credit_ledger) AS credits,"
        " (SELECT count(*) FROM ledger_export_positions) AS positions,"
        " (SELECT count(*) FROM model_prices) AS prices,"
        " (SELECT row(s.*)::text FROM ledger_export_state AS s) AS cursor"
    )
    assert dict(after) == dict(before)
    assert (before["ledger"], before["positions"]) == (1, 1)

    # The export neither skips nor fails: the next rows (a settlement and an
    # adjustment, both through the service's functions) get ids 2 and 3.
    await _one_settled(limiter)
    await store.adjust(tenant="acme", tokens=-2, reason="provider credit")
    rest = [e async for e in store.export(1, limit=None, page_rows=10, number_limit=10)]
    assert [(e.export_id, e.entry_kind) for e in rest] == [(2, "usage"), (3, "adjustment")]
    assert await db.fetchval("SELECT sum(input_tokens + output_tokens) FROM usage_ledger") == (
        2 * SETTLED_TOKENS - 2
    )


async def test_the_service_writes_ids_and_times_the_database_chose(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await _one_settled(limiter)
    row = await db.fetchrow(
        "SELECT entry_id, xact_id::text::bigint AS xact, recorded_at,"
        " clock_timestamp() - recorded_at AS age FROM usage_ledger"
    )
    # The identity's first value, a real transaction id, and a time of now.
    assert row["entry_id"] == 1
    assert row["xact"] > 1
    assert 0 <= row["age"].total_seconds() < 60


async def test_the_ledger_writers_run_as_the_owner_with_a_pinned_path(
    db: asyncpg.Connection,
) -> None:
    rows = await db.fetch(
        "SELECT proname, prosecdef, proconfig FROM pg_proc"
        " WHERE pronamespace = 'public'::regnamespace AND proname = ANY($1::text[])"
        " ORDER BY proname",
        [
            "lq_finish",
            "lq_credit_topup",
            "lq_credit_apply",
            "lq_delete_tenant",
            "lq_ledger_adjust",
            "lq_set_price",
            "lq_export_ledger",
            "lq_import_builtin_prices",
        ],
    )
    assert [r["proname"] for r in rows] == [
        "lq_credit_apply",
        "lq_credit_topup",
        "lq_delete_tenant",
        "lq_export_ledger",
        "lq_finish",
        "lq_import_builtin_prices",
        "lq_ledger_adjust",
        "lq_set_price",
    ]
    for r in rows:
        assert r["prosecdef"], r["proname"]
        assert "search_path=pg_catalog, public" in r["proconfig"], r["proname"]


async def test_an_adjustment_is_bounded_by_what_a_correction_needs(
    limiter: Limiter, app_connection: asyncpg.Connection, db: asyncpg.Connection
) -> None:
    await _one_settled(limiter)  # acme recorded 5 in, 7 out
    store = LedgerStore(app_connection)
    with pytest.raises(InvalidRequest, match="between"):
        await store.adjust(tenant="acme", tokens=MAX_ADJUSTMENT_TOKENS + 1, reason="typo")
    # Past the store's own check, the function refuses too (an insider calls it).
    with pytest.raises(InvalidRequest, match="1000000000"), translate_errors(own_refusals=True):
        await app_connection.fetch(
            "SELECT * FROM lq_ledger_adjust('acme', NULL, NULL, 0, $1, 'x')", 10**12
        )
    # Taking back more than was recorded would hide usage from the invoice.
    with pytest.raises(InvalidRequest, match="cannot take back more"):
        await store.adjust(tenant="acme", tokens=-8, reason="hide it")
    taken = await store.adjust(tenant="acme", tokens=-7, reason="provider credit")
    assert taken.output_tokens == -7
    rows = await db.fetch("SELECT entry_kind, output_tokens FROM usage_ledger ORDER BY entry_id")
    assert [tuple(r) for r in rows] == [("usage", 7), ("adjustment", -7)]


async def test_the_reporting_role_takes_no_advisory_lock_and_has_bounded_sessions(
    reporting_connection: asyncpg.Connection, app_connection: asyncpg.Connection
) -> None:
    for statement in (
        "SELECT pg_advisory_lock(hashtextextended('llmquota.global_layer', 0))",
        "SELECT pg_try_advisory_lock(hashtextextended('llmquota.migrate', 0))",
        "SELECT pg_advisory_xact_lock(1)",
        "SELECT pg_try_advisory_xact_lock(1, 2)",
        "SELECT pg_advisory_lock_shared(1)",
        "SELECT lq_lock_idempotency_keys(ARRAY['acme'], ARRAY['k'])",
    ):
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await reporting_connection.fetchval(statement)
    assert await reporting_connection.fetchval("SELECT count(*) FROM pg_locks WHERE "
                                               "locktype = 'advisory'") == 0  # fmt: skip
    # Releasing is left to everyone (it touches only the caller's own locks;
    # asyncpg's pool reset calls it).
    await reporting_connection.execute("SELECT pg_advisory_unlock_all()")
    # The service still can.
    assert await app_connection.fetchval("SELECT pg_try_advisory_xact_lock(1)") is True
    settings = {
        name: await reporting_connection.fetchval(f"SHOW {name}")
        for name in ("statement_timeout", "lock_timeout", "idle_in_transaction_session_timeout")
    }
    assert settings == {
        "statement_timeout": "5min",
        "lock_timeout": "5s",
        "idle_in_transaction_session_timeout": "1min",
    }
    app_settings = {
        name: await app_connection.fetchval(f"SHOW {name}")
        for name in ("statement_timeout", "lock_timeout", "idle_in_transaction_session_timeout")
    }
    assert app_settings == {
        "statement_timeout": "5s",
        "lock_timeout": "2s",
        "idle_in_transaction_session_timeout": "1min",
    }


async def test_an_idle_reporting_transaction_is_ended(
    reporting_dsn: str, db: asyncpg.Connection
) -> None:
    connection = await asyncpg.connect(reporting_dsn)
    try:
        # A shorter bound for the test: the role's is a minute.
        await connection.execute("SET idle_in_transaction_session_timeout = '300ms'")
        transaction = connection.transaction()
        await transaction.start()
        await connection.fetchval("SELECT count(*) FROM reporting.ledger_entries")
        await asyncio.sleep(1.0)
        with pytest.raises((asyncpg.PostgresError, asyncpg.InterfaceError, ConnectionError)):
            await connection.fetchval("SELECT 1")
    finally:
        await connection.close()
    assert (
        await db.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE usename = 'llmquota_reporting'"
            " AND state LIKE 'idle in transaction%'"
        )
        == 0
    )


async def test_partition_upkeep_never_reports_success_without_its_lock(
    limiter: Limiter, app_connection: asyncpg.Connection
) -> None:
    # Another sweeper (the only kind of role that may take the lock) holds it
    # and does not let go: the upkeep waits its bounded 1 s, then fails.
    transaction = app_connection.transaction()
    await transaction.start()
    await app_connection.execute(
        "SELECT pg_advisory_xact_lock(hashtextextended('llmquota.usage_ledger.partitions', 0))"
    )
    started = time.monotonic()
    try:
        with pytest.raises(StoreUnavailable, match="LockNotAvailable"):
            await limiter.sweep()
    finally:
        await transaction.rollback()
    waited = time.monotonic() - started
    assert 0.9 <= waited < 30
    # Released: the next run does the work and says so.
    report = await limiter.sweep()
    assert report.expired == 0
