"""A layer's policy rules: checked on every policy write, never on a debit.

Migration 0036 moved the 27 CHECK constraints of `limit_layers` that name no
balance column into one function run by two triggers (before each row an
INSERT writes, and after each row an UPDATE of any column but the balances
writes), so that admission and settlement stop paying for them. These tests
hold it to what the CHECKs did: each rule refuses what its CHECK refused,
with the same SQLSTATE, constraint name and message, and changes nothing,
an upsert's proposed row included; the UPDATE trigger's columns are every
column but the balances (a column added later must join them); and an
admission or a settlement never fires it. The rules' refusals at head are
marked citus: on a Citus cluster the triggers run on the shards, and in a
cell on the cell's worker.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg
import pytest

from llmquota.admission.limiter import Limiter
from llmquota.config import Settings
from llmquota.store import migrate
from tests.conftest import TEST_CELLS
from tests.integration.support import put

IN_A_CELL = TEST_CELLS > 0

BALANCES = {"tokens", "requests", "in_flight", "refilled_at"}

# The rows every statement below starts from, on both databases.
ROWS = """
INSERT INTO plans (plan) VALUES ('pro');
INSERT INTO tenants (tenant) VALUES ('acme');
INSERT INTO limit_layers (scope, tenant, route, tokens_per_minute, token_burst, tokens,
                          requests_per_minute, request_burst, requests, max_in_flight)
VALUES ('global', NULL, NULL, 60000, 60000, 60000, 600, 600, 600, 40),
       ('tenant', 'acme', NULL, 6000, 6000, 6000, 60, 60, 60, 4),
       ('route', 'acme', 'chat', 600, 600, 600, 6, 6, 6, NULL);
"""
TENANT = "WHERE scope = 'tenant'"
GLOBAL = "WHERE scope = 'global'"
ROUTE = "WHERE scope = 'route'"

# Each rule, and a write that breaks it first (by name, as PostgreSQL checks).
BREAKS = {
    "limit_layers_admission": f"UPDATE limit_layers SET admission = 'lazy' {TENANT}",
    "limit_layers_allowed_models_check": (
        f"UPDATE limit_layers SET allowed_models = '{{gpt-4o}}' {TENANT}"
    ),
    "limit_layers_api_key_check": f"UPDATE limit_layers SET scope = 'key' {TENANT}",
    "limit_layers_cache_mode": f"""UPDATE limit_layers SET cache = '{{"ttl": 5}}' {TENANT}""",
    "limit_layers_cache_scope_check": (
        f"""UPDATE limit_layers SET cache = '{{"mode": "exact"}}' {GLOBAL}"""
    ),
    "limit_layers_ceiling_check": f"UPDATE limit_layers SET ceiling = 'no spaces' {TENANT}",
    "limit_layers_ceiling_layer_check": (
        f"UPDATE limit_layers SET ceiling = 'gpt', model_patterns = '{{gpt-*}}' {TENANT}"
    ),
    "limit_layers_check1": f"UPDATE limit_layers SET route = 'chat' {TENANT}",
    "limit_layers_check2": f"UPDATE limit_layers SET token_burst = NULL {TENANT}",
    "limit_layers_check3": f"UPDATE limit_layers SET request_burst = NULL {TENANT}",
    "limit_layers_failure_mode_check": f"UPDATE limit_layers SET failure_mode = 'maybe' {TENANT}",
    "limit_layers_ladder_check": f"UPDATE limit_layers SET shed_above = '{{0.5}}' {TENANT}",
    "limit_layers_lease_seconds_check": f"UPDATE limit_layers SET lease_seconds = 0 {TENANT}",
    "limit_layers_max_in_flight_check": f"UPDATE limit_layers SET max_in_flight = 0 {TENANT}",
    "limit_layers_output_estimate_check": (
        f"""UPDATE limit_layers SET output_estimate = '{{"tokens": 5}}' {TENANT}"""
    ),
    "limit_layers_output_estimate_scope_check": (
        f"""UPDATE limit_layers SET output_estimate = '{{"strategy": "fixed"}}' {GLOBAL}"""
    ),
    "limit_layers_plan_check": f"UPDATE limit_layers SET plan = 'pro' {GLOBAL}",
    "limit_layers_priority_check": f"UPDATE limit_layers SET priority = 7 {TENANT}",
    "limit_layers_request_burst_check": (
        f"UPDATE limit_layers SET request_burst = 0, requests = 0 {TENANT}"
    ),
    "limit_layers_requests_per_minute_check": (
        f"UPDATE limit_layers SET requests_per_minute = 0 {TENANT}"
    ),
    "limit_layers_route_check": f"UPDATE limit_layers SET route = 'no spaces' {ROUTE}",
    "limit_layers_scope_check": f"UPDATE limit_layers SET scope = 'planet' {TENANT}",
    "limit_layers_shard_check": f"UPDATE limit_layers SET shards = 2 {TENANT}",
    "limit_layers_shared_check": f"UPDATE limit_layers SET tenant = NULL {TENANT}",
    "limit_layers_token_burst_check": (
        f"UPDATE limit_layers SET token_burst = 0, tokens = 0 {TENANT}"
    ),
    "limit_layers_tokens_per_minute_check": (
        f"UPDATE limit_layers SET tokens_per_minute = 0 {TENANT}"
    ),
    "limit_layers_upstream_ceiling": f"UPDATE limit_layers SET upstream = 'azure' {TENANT}",
}
# An INSERT is held to the same rules: a route layer without its route.
INSERT_BREAKS = (
    "INSERT INTO limit_layers (scope, tenant, tokens_per_minute, token_burst, tokens)"
    " VALUES ('route', 'acme', 600, 600, 600)"
)
# The same layer with its route goes in.
INSERT_KEEPS = (
    "INSERT INTO limit_layers (scope, tenant, route, tokens_per_minute, token_burst, tokens)"
    " VALUES ('route', 'acme', 'summary', 600, 600, 600)"
)
# Rows an INSERT proposes, refused before any key is looked at, as by a CHECK:
# the tenant's layer again (a duplicate key) with a priority out of range,
# plainly and as upserts.
DUPLICATE = (
    "INSERT INTO limit_layers (scope, tenant, tokens_per_minute, token_burst, tokens,"
    " requests_per_minute, request_burst, requests, priority)"
    " VALUES ('tenant', 'acme', 6000, 6000, 6000, 60, 60, 60, 9)"
)
ON_KEY = " ON CONFLICT (scope, tenant, route, ceiling, shard, api_key_id)"
PROPOSED_BREAKS = {
    "a duplicate": DUPLICATE,
    "do nothing": DUPLICATE + ON_KEY + " DO NOTHING",
    "a balance update": DUPLICATE + ON_KEY + " DO UPDATE SET tokens = 1",
}
EVERY_ROW = "SELECT * FROM limit_layers ORDER BY layer_id"


@pytest.fixture
async def checks_dsn(empty_database_dsn: str) -> AsyncIterator[str]:
    """A database at revision 0035, where the rules were CHECK constraints, with ROWS."""
    await asyncio.to_thread(migrate.upgrade, empty_database_dsn, "0035")
    connection = await asyncpg.connect(empty_database_dsn)
    try:
        await connection.execute(ROWS)
    finally:
        await connection.close()
    yield empty_database_dsn


@pytest.fixture
async def rules_db(db: asyncpg.Connection) -> asyncpg.Connection:
    """The test database at head, with ROWS."""
    await db.execute(ROWS)
    return db


async def _refusal(connection: asyncpg.Connection, statement: str) -> tuple[str, str | None, str]:
    """What `statement` raised: SQLSTATE, constraint name, message (the detail,
    the failing row, is written another way: PostgreSQL's own form is not
    PL/pgSQL's); and that it changed nothing."""
    before = await connection.fetch(EVERY_ROW)
    with pytest.raises(asyncpg.PostgresError) as raised:
        await connection.execute(statement)
    assert await connection.fetch(EVERY_ROW) == before
    error = raised.value
    return error.sqlstate, error.constraint_name, error.message  # type: ignore[attr-defined]


async def _refusal_at_0035(checks_dsn: str, statement: str) -> tuple[str, str | None, str]:
    """What `statement` raised where the rules were CHECKs (see _refusal)."""
    with_checks = await asyncpg.connect(checks_dsn)
    try:
        return await _refusal(with_checks, statement)
    finally:
        await with_checks.close()


def _check_violation(rule: str, *, in_a_cell: bool = False) -> tuple[str, str | None, str]:
    """What PostgreSQL raises for a CHECK constraint named `rule` of limit_layers.

    In a cell every statement runs on a Citus worker, and Citus passes the
    worker's error on without its constraint name: a CHECK's too, whose
    message then names the shard (limit_layers_102058), where the rules'
    names the table."""
    return (
        "23514",
        None if in_a_cell else rule,
        f'new row for relation "limit_layers" violates check constraint "{rule}"',
    )


@pytest.mark.parametrize("rule", sorted(BREAKS))
async def test_each_check_refused_its_breaking_write_at_0035(checks_dsn: str, rule: str) -> None:
    assert await _refusal_at_0035(checks_dsn, BREAKS[rule]) == _check_violation(rule)


@pytest.mark.citus
async def test_each_rule_refuses_what_its_check_refused_and_changes_nothing(
    rules_db: asyncpg.Connection,
) -> None:
    """The same answer as the CHECK's at 0035 (the test above), on every
    deployment: on Citus the triggers run on the shards, in a cell too. One
    test for all rules, each write in turn on one database: a database costs
    Citus seconds to make."""
    refusals = {rule: await _refusal(rules_db, BREAKS[rule]) for rule in sorted(BREAKS)}
    assert refusals == {rule: _check_violation(rule, in_a_cell=IN_A_CELL) for rule in BREAKS}


@pytest.mark.parametrize("case", sorted(PROPOSED_BREAKS))
async def test_a_proposed_row_is_refused_before_its_key_as_by_its_check(
    rules_db: asyncpg.Connection, checks_dsn: str, case: str
) -> None:
    before = await _refusal_at_0035(checks_dsn, PROPOSED_BREAKS[case])
    assert before[:2] == ("23514", "limit_layers_priority_check")
    assert await _refusal(rules_db, PROPOSED_BREAKS[case]) == before


@pytest.mark.citus
async def test_an_insert_is_held_to_the_rules(rules_db: asyncpg.Connection) -> None:
    refusal = await _refusal(rules_db, INSERT_BREAKS)
    assert refusal == _check_violation("limit_layers_check1", in_a_cell=IN_A_CELL)
    await rules_db.execute(INSERT_KEEPS)
    assert await rules_db.fetchval("SELECT count(*) FROM limit_layers") == 4


@pytest.mark.citus
async def test_a_write_that_keeps_every_rule_goes_through(rules_db: asyncpg.Connection) -> None:
    updated = await rules_db.execute(
        "UPDATE limit_layers SET priority = 2, lease_seconds = 60, failure_mode = 'open',"
        f""" cache = '{{"mode": "exact"}}', shed_above = '{{0.5}}', shed_admit = '{{1}}',"""
        f" shed_small = '{{100}}' {TENANT}"
    )
    assert updated == "UPDATE 1"


async def test_the_update_trigger_covers_every_column_but_the_balances(
    rules_db: asyncpg.Connection,
) -> None:
    columns = {
        row["attname"]
        for row in await rules_db.fetch(
            "SELECT attname FROM pg_attribute WHERE attrelid = 'limit_layers'::regclass"
            " AND attnum > 0 AND NOT attisdropped"
        )
    }
    triggered = {
        row["attname"]
        for row in await rules_db.fetch(
            """SELECT a.attname
                 FROM pg_trigger AS t
                 JOIN pg_attribute AS a
                   ON a.attrelid = t.tgrelid AND a.attnum = ANY (t.tgattr::int2[])
                WHERE t.tgrelid = 'limit_layers'::regclass
                  AND t.tgname = 'limit_layers_policy_rules_on_update'"""
        )
    }
    assert columns >= BALANCES
    assert triggered == columns - BALANCES
    triggers = {
        row["tgname"]: row["definition"]
        for row in await rules_db.fetch(
            "SELECT tgname, pg_get_triggerdef(oid) AS definition FROM pg_trigger"
            " WHERE tgrelid = 'limit_layers'::regclass AND tgname LIKE '%policy_rules%'"
        )
    }
    assert " BEFORE INSERT ON " in triggers["limit_layers_policy_rules_on_insert"]
    assert " AFTER UPDATE OF " in triggers["limit_layers_policy_rules_on_update"]
    assert len(triggers) == 2
    # The CHECKs left each name a balance: a debit is checked against them.
    for row in await rules_db.fetch(
        """SELECT conname, ARRAY(SELECT attname FROM pg_attribute
                                  WHERE attrelid = conrelid AND attnum = ANY (conkey)) AS names
             FROM pg_constraint
            WHERE conrelid = 'limit_layers'::regclass AND contype = 'c'"""
    ):
        assert set(row["names"]) & BALANCES, row["conname"]


async def test_admissions_and_settlements_never_fire_the_rules(
    owner_dsn: str, app_dsn: str, settings: Settings, limiter: Limiter, db: asyncpg.Connection
) -> None:
    await put(
        limiter,
        "tenant",
        "acme",
        tokens_per_minute=60_000,
        requests_per_minute=600,
        max_in_flight=8,
    )
    # Sessions that start from now on count their function calls (the policy
    # write above, which fired the rules, was not counted).
    database = await db.fetchval("SELECT current_database()")
    await db.execute(f"ALTER DATABASE \"{database}\" SET track_functions = 'all'")
    counted = await Limiter.connect(app_dsn, settings)
    try:
        for _ in range(5):
            reservation = await counted.admit(
                tenant="acme", model="gpt-4o", input_tokens=10, max_tokens=100
            )
            await counted.settle(reservation.reservation_id, input_tokens=10, output_tokens=20)
    finally:
        await counted.close()  # its sessions end, and their counts reach the statistics
    calls = await _function_calls(owner_dsn, "lq_finish")
    assert calls["lq_finish"] >= 5
    assert calls["lq_admit"] >= 5
    assert "lq_layer_policy_rules" not in calls
    # And the counting would have seen them: a policy write fires them.
    writer = await Limiter.connect(app_dsn, settings)
    try:
        await put(writer, "tenant", "acme", tokens_per_minute=30_000, requests_per_minute=600)
    finally:
        await writer.close()
    assert (await _function_calls(owner_dsn, "lq_layer_policy_rules"))["lq_layer_policy_rules"] >= 1


async def _function_calls(owner_dsn: str, awaited: str) -> dict[str, int]:
    """Calls per function, as the sessions that ended reported them, once
    `awaited` is among them (their statistics reach the server as they end)."""
    for _ in range(50):
        fresh = await asyncpg.connect(owner_dsn)
        try:
            rows = await fresh.fetch("SELECT funcname, calls FROM pg_stat_user_functions")
        finally:
            await fresh.close()
        calls = {row["funcname"]: row["calls"] for row in rows}
        if awaited in calls:
            return calls
        await asyncio.sleep(0.1)
    raise AssertionError(f"no call of {awaited} was counted")
