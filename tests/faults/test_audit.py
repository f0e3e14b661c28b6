"""`llmquota audit`: recompute the counters from the journal, report drift."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import asyncpg
import httpx
import pytest

from llmquota.admission.limiter import Limiter
from llmquota.api.app import create_app
from llmquota.config import Settings
from tests.faults.conftest import PYTHON, put, worker_env


async def audit_cli(dsn: str) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        PYTHON,
        "-m",
        "llmquota.cli",
        "audit",
        env=worker_env(LLMQUOTA_DATABASE_URL=dsn),
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await process.communicate()
    return int(process.returncode or 0), out.decode()


async def test_audit_finds_no_drift_then_exactly_the_drift_injected(
    limiter: Limiter, database_dsn: str, db: asyncpg.Connection
) -> None:
    await put(limiter, "tenant", "acme", tokens_per_minute=60_000, max_in_flight=10)
    held = [
        await limiter.admit(tenant="acme", model="m", input_tokens=5, max_tokens=5)
        for _ in range(4)
    ]
    await held[0].settle(input_tokens=5, output_tokens=2)
    await held[1].release()

    code, out = await audit_cli(database_dsn)
    assert code == 0, out
    assert "journal: active=2 reserved_tokens=20 finished=2" in out
    assert out.strip().endswith("no drift")

    # A permit counter that lost track, and a settlement whose figures were edited.
    await db.execute("UPDATE limit_layers SET in_flight = in_flight + 1 WHERE tenant = 'acme'")
    await db.execute(
        "UPDATE reservations SET charged_tokens = 99 WHERE reservation_id = $1",
        held[0].reservation_id,
    )
    code, out = await audit_cli(database_dsn)
    assert code == 1
    drift = sorted(line for line in out.splitlines() if line.startswith("DRIFT"))
    assert drift == [
        f"DRIFT charged_tokens {held[0].reservation_id}: expected 7, found 99",
        "DRIFT in_flight layer 1 (tenant acme -): expected 2, found 3",
        f"DRIFT refunded_tokens {held[0].reservation_id}: expected 0, found 3",
    ]
    assert out.strip().endswith("drift: 3 (charged_tokens 1, in_flight 1, refunded_tokens 1)")

    # Put the books right again (the autouse audit checks them after the test).
    await db.execute("UPDATE limit_layers SET in_flight = in_flight - 1 WHERE tenant = 'acme'")
    await db.execute(
        "UPDATE reservations SET charged_tokens = 7 WHERE reservation_id = $1",
        held[0].reservation_id,
    )
    for r in held[2:]:
        await r.release()


# gpt-4o at $2.50 in and $10 out per million tokens.
PRICES = "INSERT INTO model_prices VALUES ('gpt-4o', '2020-01-01', 2.50, 10.00)"
ADMIN_KEY = "lq_audit_admin_key_0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


async def traffic(database_dsn: str, db: asyncpg.Connection) -> dict[str, uuid.UUID]:
    """Real traffic over REST through every kind of book the audit keeps: a
    sharded global layer resharded under an open reservation, a prepaid tenant
    with a calendar quota in tokens and cost, and one reservation settled
    above its reservation, one released, one settled late and one still open.
    Returns their ids by what became of them."""
    await db.execute(PRICES)
    settings = Settings(  # type: ignore[call-arg]
        admin_key=ADMIN_KEY,
        pool_min_size=1,
        pool_max_size=4,
        decision_deadline_ms=60_000,
        _env_file=None,
    )
    app = create_app(settings, dsn=database_dsn)
    ids: dict[str, uuid.UUID] = {}
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://llmquota") as client:

            async def call(method: str, url: str, want: int, **kwargs: Any) -> Any:
                r = await client.request(method, url, **kwargs)
                assert r.status_code == want, (url, r.text)
                return r.json()

            global_policy = {
                "tokens_per_minute": 600_000,
                "token_burst": 1_000_000,
                "requests_per_minute": 6_000,
                "request_burst": 1_000,
            }
            await call(
                "PUT",
                "/v1/policies/global",
                200,
                headers=ADMIN,
                json={**global_policy, "shards": 2},
            )
            await call(
                "PUT",
                "/v1/tenants/acme/policy",
                200,
                headers=ADMIN,
                json={
                    "tokens_per_minute": 60_000,
                    "requests_per_minute": 600,
                    "max_in_flight": 10,
                    "prepaid": True,
                },
            )
            key = (await call("POST", "/v1/tenants/acme/keys", 201, headers=ADMIN))["key"]
            acme = {"Authorization": f"Bearer {key}"}
            await call(
                "POST",
                "/v1/tenants/acme/credits",
                201,
                headers=ADMIN,
                json={"amount": "10", "reference": "inv-1"},
            )
            await call(
                "PUT",
                "/v1/tenants/acme/quotas/daily",
                201,
                headers=ADMIN,
                json={"period": "day", "tokens": 1_000_000, "cost": "5"},
            )

            async def admit() -> uuid.UUID:
                body = {"tenant": "acme", "model": "gpt-4o", "input_tokens": 100, "max_tokens": 100}
                answer = await call("POST", "/v1/admit", 201, headers=acme, json=body)
                return uuid.UUID(answer["reservation_id"])

            def settle_url(rid: uuid.UUID) -> str:
                return f"/v1/reservations/{rid}/settle"

            ids = {what: await admit() for what in ("settled", "released", "late", "open")}
            # 250 used of 200 reserved: nothing refunded, the excess debited.
            await call(
                "POST",
                settle_url(ids["settled"]),
                200,
                headers=acme,
                json={"input_tokens": 100, "output_tokens": 150},
            )
            await call("POST", f"/v1/reservations/{ids['released']}/release", 200, headers=acme)
            await db.execute(
                "UPDATE reservations SET lease_expires_at = clock_timestamp() - interval '1 s'"
                " WHERE reservation_id = $1",
                ids["late"],
            )
            late = await call(
                "POST",
                settle_url(ids["late"]),
                200,
                headers=acme,
                json={"input_tokens": 100, "output_tokens": 20},
            )
            assert late["late"] is True
            # Three shards now, with a reservation still open on one of the two.
            await call(
                "PUT",
                "/v1/policies/global",
                200,
                headers=ADMIN,
                json={**global_policy, "shards": 3},
            )
    return ids


async def drop_check(db: asyncpg.Connection, table: str, definition: str) -> None:
    """Drop the CHECK constraint of `table` whose definition contains `definition`."""
    name = await db.fetchval(
        """SELECT conname FROM pg_constraint
            WHERE conrelid = $1::regclass AND contype = 'c'
              AND pg_get_constraintdef(oid) LIKE '%' || $2 || '%'""",
        table,
        definition,
    )
    assert name is not None, definition
    await db.execute(f'ALTER TABLE {table} DROP CONSTRAINT "{name}"')


# Each drift, made directly in SQL as the owner, and the checks it must trip.
# $1 is the id of the reservation the statement needs (see `traffic`).
DRIFTS: dict[str, tuple[str | None, list[str], set[str]]] = {
    "in_flight": (
        None,
        ["UPDATE limit_layers SET in_flight = in_flight + 1 WHERE tenant = 'acme'"],
        {"in_flight"},
    ),
    "reservation_layers": (
        "open",
        [
            "UPDATE reservations SET layer_ids = layer_ids || 999999::bigint "
            "WHERE reservation_id = $1"
        ],
        {"reservation_layers"},
    ),
    "over_capacity": (
        None,
        ["UPDATE limit_layers SET tokens = token_burst + 5 WHERE tenant = 'acme'"],
        {"over_capacity"},
    ),
    "requests_over_capacity": (
        None,
        ["UPDATE limit_layers SET requests = request_burst + 5 WHERE tenant = 'acme'"],
        {"requests_over_capacity"},
    ),
    "global_shard_rows": (
        None,
        [
            "DELETE FROM limit_layers WHERE scope = 'global' AND shard = "
            "(SELECT max(shard) FROM limit_layers WHERE scope = 'global' "
            "AND in_flight = 0)"
        ],
        {"global_shard_rows", "global_shard_share"},
    ),
    "global_shard_share": (
        None,
        [
            "UPDATE limit_layers SET token_burst = token_burst "
            "+ CASE shard WHEN 0 THEN 1 ELSE -1 END, tokens = least(tokens, token_burst - 1) "
            "WHERE scope = 'global' AND shard IN (0, 1)"
        ],
        {"global_shard_share"},
    ),
    "usage_rows": (
        "released",
        [
            "INSERT INTO usage_ledger (reservation_id, entry_kind, tenant, model, input_tokens, "
            "output_tokens, reserved_tokens, outcome) "
            "VALUES ($1, 'usage', 'acme', 'gpt-4o', 0, 0, 0, 'cancelled')"
        ],
        {"usage_rows"},
    ),
    "late_rows": (
        "settled",
        [
            "INSERT INTO usage_ledger (reservation_id, entry_kind, tenant, model, input_tokens, "
            "output_tokens, reserved_tokens, outcome) "
            "VALUES ($1, 'late', 'acme', 'gpt-4o', 0, 0, 0, 'late')"
        ],
        {"late_rows"},
    ),
    "charged_tokens": (
        "settled",
        ["UPDATE reservations SET charged_tokens = charged_tokens + 1 WHERE reservation_id = $1"],
        {"charged_tokens"},
    ),
    "refunded_tokens": (
        "settled",
        ["UPDATE reservations SET refunded_tokens = 1 WHERE reservation_id = $1"],
        {"refunded_tokens"},
    ),
    "ledger_tokens": (
        "settled",
        [
            "UPDATE reservations SET settled_output_tokens = 151, "
            "charged_tokens = 251 WHERE reservation_id = $1"
        ],
        {"ledger_tokens"},
    ),
    "credit_balance": (
        None,
        ["UPDATE credit_accounts SET balance = balance + 1"],
        {"credit_balance"},
    ),
    "credit_balance_after": (
        None,
        [
            "INSERT INTO credit_ledger (tenant, entry_kind, amount, balance_after, reason) "
            "VALUES ('acme', 'adjustment', 0, 999, 'forged')"
        ],
        {"credit_balance_after"},
    ),
    "credit_reserved": (
        None,
        ["UPDATE credit_accounts SET reserved = reserved + 0.01"],
        {"credit_reserved"},
    ),
    "quota_reserved_tokens": (
        None,
        ["UPDATE quota_windows SET reserved_tokens = reserved_tokens + 1"],
        {"quota_reserved_tokens"},
    ),
    "quota_reserved_cost": (
        None,
        ["UPDATE quota_windows SET reserved_cost = reserved_cost + 0.000001"],
        {"quota_reserved_cost"},
    ),
    "quota_charged_tokens": (
        None,
        ["UPDATE quota_windows SET charged_tokens = charged_tokens + 1"],
        {"quota_charged_tokens"},
    ),
    "quota_charged_cost": (
        None,
        ["UPDATE quota_windows SET charged_cost = charged_cost + 0.000001"],
        {"quota_charged_cost"},
    ),
}
# The schema forbids a balance above its burst: those drifts drop the constraint first.
CONSTRAINTS = {"over_capacity": "tokens <= ", "requests_over_capacity": "requests <= "}


@pytest.mark.constructs_drift
@pytest.mark.parametrize("drift", sorted(DRIFTS))
async def test_each_drift_is_named_by_the_audit_and_exits_1(
    drift: str, database_dsn: str, db: asyncpg.Connection
) -> None:
    ids = await traffic(database_dsn, db)
    code, out = await audit_cli(database_dsn)
    assert code == 0, out
    assert "journal: active=1 " in out and out.strip().endswith("no drift"), out

    needs, statements, names = DRIFTS[drift]
    if drift in CONSTRAINTS:
        await drop_check(db, "limit_layers", CONSTRAINTS[drift])
    for statement in statements:
        await db.execute(statement, *([ids[needs]] if needs else []))

    code, out = await audit_cli(database_dsn)
    assert code == 1, out
    found = {line.split()[1] for line in out.splitlines() if line.startswith("DRIFT ")}
    assert found == names, out
    assert out.strip().splitlines()[-1].startswith("drift: "), out


# A response cache hit as sql/cache.sql writes it (as the owner): a 'usage' row
# of 0 tokens under an id of its own that no reservation has, saying what the
# provider would have billed and the hit's price.
CACHE_HIT = (
    "INSERT INTO usage_ledger (reservation_id, entry_kind, tenant, route, model, input_tokens, "
    "output_tokens, reserved_tokens, outcome, serving_path, saved_input_tokens, "
    "saved_output_tokens, price_usd) "
    "VALUES ($1, 'usage', 'acme', NULL, 'gpt-4o', 0, 0, 0, 'ok', 'cache', 100, 150, 0.001)"
)


async def test_a_cache_hit_in_the_ledger_is_no_drift_and_hides_none(
    database_dsn: str, db: asyncpg.Connection
) -> None:
    """No reservation behind a cache hit's row: no check reads it as a missing or
    purged reservation, so none reports it, and none is switched off by it (the
    quota windows' charged check still sees drift in the hit's window)."""
    await traffic(database_dsn, db)
    await db.execute(CACHE_HIT, uuid.uuid4())
    assert await db.fetch("SELECT * FROM lq_audit()") == []

    await db.execute("UPDATE quota_windows SET charged_tokens = charged_tokens + 1")
    found = {r["check_name"] for r in await db.fetch("SELECT * FROM lq_audit()")}
    assert found == {"quota_charged_tokens"}
    await db.execute("UPDATE quota_windows SET charged_tokens = charged_tokens - 1")
