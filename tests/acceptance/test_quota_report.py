"""`llmquota report quota_usage` agrees with the usage ledger to the token and the cent.

A mixed workload runs through the real Limiter: three tenants, quotas in
five time zones with model globs and a route, four models (one unpriced), a
price change in the middle, settlements above and below the reservation,
releases, reservations expired by `llmquota sweep` (a subprocess) and late
settles of some of them, and reservations still open at the end. The report
runs as a subprocess as the read-only reporting role. The expected figures
are recomputed here from `usage_ledger` and `reservations` alone, in Python:
each usage or late row is matched to the quotas of its tenant, route and
model, placed in the calendar window of its `recorded_at` (zoneinfo, not the
database's functions) and priced at the `model_prices` row in force then, as
the finance reports price it.
"""

from __future__ import annotations

import asyncio
import fnmatch
import json
import random
from collections import defaultdict
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any
from zoneinfo import ZoneInfo

import asyncpg

from llmquota.admin.alerts import AlertService
from llmquota.admission.limiter import Limiter
from llmquota.domain.errors import LimiterError
from llmquota.domain.policy import Policy
from llmquota.domain.quotas import quota_spec
from tests.support import REPORTING_ROLE, dsn_as, run_cli

SEED = 20261201
PRICES = {"gpt-4o": ("2.50", "10.00"), "gpt-4o-mini": ("0.15", "0.60"), "claude-3": ("3", "15")}
MODELS = [*PRICES, "local-llama"]  # local-llama has no price
QUOTAS = [  # tenant, route, name, period, zone, tokens, cost, models
    ("acme", None, "daily", "day", "Europe/Berlin", 400_000, "3.00", None),
    ("acme", None, "gpt-monthly", "month", "America/New_York", None, "50", ["gpt-4o*"]),
    ("acme", "chat", "chat-daily", "day", "UTC", 60_000, None, None),
    ("globex", None, "claude", "day", "Asia/Kolkata", 150_000, None, ["claude-*"]),
    ("globex", None, "all", "month", "Pacific/Auckland", 10_000_000, None, None),
]
Key = tuple[str, str | None, str, datetime]  # tenant, route, quota, window_start (UTC)


async def _setup(limiter: Limiter, db: asyncpg.Connection) -> None:
    for tenant in ("acme", "globex", "initech"):
        await limiter.store.put_policy("tenant", tenant, None, Policy(tokens_per_minute=10**8))
    for model, (price_in, price_out) in PRICES.items():
        await db.execute(
            "INSERT INTO model_prices VALUES ($1, '2020-01-01', $2::numeric, $3::numeric)",
            model, price_in, price_out,
        )  # fmt: skip
    service = AlertService(limiter.store)
    for tenant, route, name, period, zone, tokens, cost, models in QUOTAS:
        spec = quota_spec(period=period, timezone=zone, tokens=tokens, cost=cost, models=models)
        await service.put_quota(tenant, route, name, spec)


async def _admit(limiter: Limiter, rng: random.Random, lease_seconds: int) -> Any:
    tenant = rng.choice(["acme", "acme", "globex", "initech"])
    try:
        return await limiter.admit(
            tenant=tenant,
            model=rng.choice(MODELS if tenant != "acme" else list(PRICES)),
            route=rng.choice([None, "chat", "batch"]),
            input_tokens=rng.randint(50, 3_000),
            max_tokens=rng.randint(100, 4_000),
            lease_seconds=lease_seconds,
        )
    except LimiterError as refused:
        return refused


async def _settle(limiter: Limiter, rng: random.Random, r: Any, outcome: str = "ok") -> None:
    # Now and then above the reservation: usage the provider counted anyway.
    output = rng.randint(0, r.reserved_tokens - r.input_tokens + (500 if rng.random() < 0.2 else 0))
    await limiter.settle(
        r.reservation_id,
        input_tokens=r.input_tokens + rng.randint(-20, 40),
        output_tokens=output,
        outcome=outcome,
    )


async def _workload(limiter: Limiter, db: asyncpg.Connection, dsn: str) -> dict[str, int]:
    """The mixed workload; returns how many of each thing happened."""
    rng = random.Random(SEED)
    counts: dict[str, int] = defaultdict(int)
    for phase in range(2):
        if phase == 1:  # gpt-4o gets cheaper from now on, mid-workload
            await db.execute(
                "INSERT INTO model_prices VALUES ('gpt-4o', clock_timestamp(), 2.00, 8.00)"
            )
        made = await asyncio.gather(*(_admit(limiter, rng, 600) for _ in range(80)))
        doomed = await asyncio.gather(*(_admit(limiter, rng, 1) for _ in range(15)))
        ok = [r for r in made if not isinstance(r, Exception)]
        for refusal in (r for r in made + doomed if isinstance(r, Exception)):
            counts[f"refused {type(refusal).__name__}"] += 1
        settled, released, still_open = ok[: len(ok) * 7 // 10], ok[len(ok) * 7 // 10 : -5], ok[-5:]
        await asyncio.gather(*(_settle(limiter, rng, r) for r in settled))
        await asyncio.gather(*(limiter.release(r.reservation_id) for r in released))
        counts["settled"] += len(settled)
        counts["released"] += len(released)
        counts["open"] += len(still_open)
        expiring = [r for r in doomed if not isinstance(r, Exception)]
        await asyncio.sleep(1.2)  # their one-second leases run out on the database clock
        await asyncio.to_thread(run_cli, "sweep", dsn=dsn)
        counts["expired"] += len(expiring)
        ids = [r.reservation_id for r in expiring]
        states = await db.fetchval(
            "SELECT count(*) FROM reservations WHERE reservation_id = ANY($1)"
            " AND state = 'expired'",
            ids,
        )
        assert states == len(expiring)
        for r in expiring[:3]:  # the provider's answer comes after the sweep
            await _settle(limiter, rng, r)
            counts["late"] += 1
    return dict(counts)


def _window(period: str, zone: str, at: datetime) -> tuple[datetime, datetime]:
    """The calendar window holding `at`, by zoneinfo: local midnight (or the 1st) to the next."""
    local = at.astimezone(ZoneInfo(zone))
    if period == "day":
        first = date(local.year, local.month, local.day)
        after = first + timedelta(days=1)
    else:
        first = date(local.year, local.month, 1)
        after = date(first.year + first.month // 12, first.month % 12 + 1, 1)
    return tuple(  # type: ignore[return-value]
        datetime(d.year, d.month, d.day, tzinfo=ZoneInfo(zone)).astimezone(UTC)
        for d in (first, after)
    )


def _price(prices: list[asyncpg.Record], model: str, at: datetime) -> tuple[Decimal, Decimal]:
    """The price in force at `at` (the latest effective_from not after it); 0 when none."""
    in_force = [p for p in prices if p["model"] == model and p["effective_from"] <= at]
    if not in_force:
        return Decimal(0), Decimal(0)
    latest = max(in_force, key=lambda p: p["effective_from"])
    return latest["input_usd_per_million"], latest["output_usd_per_million"]


def _matches(quota: asyncpg.Record, tenant: str, route: str | None, model: str) -> bool:
    return (
        quota["tenant"] == tenant
        and quota["route"] in (None, route)
        and (not quota["models"] or any(fnmatch.fnmatchcase(model, g) for g in quota["models"]))
    )


async def _expected(db: asyncpg.Connection) -> dict[Key, dict[str, Any]]:
    """Per quota window: charged tokens and cost from the ledger, held from open reservations."""
    quotas = await db.fetch("SELECT tenant, route, name, period, timezone, models FROM quotas")
    prices = await db.fetch("SELECT * FROM model_prices")
    ledger = await db.fetch(
        "SELECT tenant, route, model, input_tokens, output_tokens, recorded_at FROM usage_ledger"
        " WHERE entry_kind IN ('usage', 'late')"
    )
    held = await db.fetch(
        "SELECT tenant, route, model, input_tokens, max_tokens, created_at FROM reservations"
        " WHERE state = 'active'"
    )
    figures: dict[Key, dict[str, Any]] = {}

    def add(q: asyncpg.Record, at: datetime, kind: str, tokens: int, cost: Decimal) -> None:
        start, end = _window(q["period"], q["timezone"], at)
        row = figures.setdefault(
            (q["tenant"], q["route"], q["name"], start),
            {"window_end": end, "charged_tokens": 0, "charged_cost": Decimal(0),
             "held_tokens": 0, "held_cost": Decimal(0), "zone": q["timezone"]},
        )  # fmt: skip
        row[f"{kind}_tokens"] += tokens
        row[f"{kind}_cost"] += cost

    for e in ledger:
        price_in, price_out = _price(prices, e["model"], e["recorded_at"])
        cost = (e["input_tokens"] * price_in + e["output_tokens"] * price_out) / 1_000_000
        for q in quotas:
            if _matches(q, e["tenant"], e["route"], e["model"]):
                add(q, e["recorded_at"], "charged", e["input_tokens"] + e["output_tokens"], cost)
    for r in held:
        price_in, price_out = _price(prices, r["model"], r["created_at"])
        cost = (r["input_tokens"] * price_in + r["max_tokens"] * price_out) / 1_000_000
        for q in quotas:
            if _matches(q, r["tenant"], r["route"], r["model"]):
                add(q, r["created_at"], "held", r["input_tokens"] + r["max_tokens"], cost)
    return figures


async def _report(dsn: str, start: date, end: date) -> dict[Key, dict[str, Any]]:
    env = {"LLMQUOTA_REPORTING_DATABASE_URL": dsn_as(dsn, REPORTING_ROLE)}
    period = ("--from", start.isoformat(), "--to", end.isoformat(), "--format", "json")
    result = await asyncio.to_thread(run_cli, "report", "quota_usage", *period, dsn=dsn, env=env)
    rows: list[dict[str, Any]] = json.loads(result.stdout)
    return {
        (r["tenant"], r["route"], r["quota_name"], datetime.fromisoformat(r["window_start"])): r
        for r in rows
    }


def _agree(report: dict[Key, dict[str, Any]], expected: dict[Key, dict[str, Any]]) -> None:
    """Every window the ledger implies is reported, with its figures, and nothing else."""
    assert sorted(report, key=str) == sorted(expected, key=str)
    for key, want in expected.items():
        got = report[key]
        assert datetime.fromisoformat(got["window_end"]) == want["window_end"], key
        assert got["charged_tokens"] == want["charged_tokens"], key
        assert Decimal(got["charged_cost"]) == want["charged_cost"], key
        assert got["usage_tokens"] == want["charged_tokens"] + want["held_tokens"], key
        assert Decimal(got["usage_cost"]) == want["charged_cost"] + want["held_cost"], key


def _local_start(key: Key, zone: str) -> date:
    return key[3].astimezone(ZoneInfo(zone)).date()


async def test_the_quota_usage_report_agrees_with_the_ledger_to_the_token_and_the_cent(
    limiter: Limiter, db: asyncpg.Connection, database_dsn: str
) -> None:
    await _setup(limiter, db)
    counts = await _workload(limiter, db, database_dsn)
    expected = await _expected(db)
    assert {k[2] for k in expected} == {q[2] for q in QUOTAS}  # every quota saw usage

    # A period wide enough for every window: all of them, with their figures.
    today = (await db.fetchval("SELECT clock_timestamp()")).date()
    _agree(await _report(database_dsn, today - timedelta(days=40), today + timedelta(days=2)),
           expected)  # fmt: skip
    # One calendar day: the windows whose local start falls on it, also in
    # zones where that local midnight is still the previous day in UTC.
    for day in (today - timedelta(days=1), today, today + timedelta(days=1)):
        on_day = {k: v for k, v in expected.items() if _local_start(k, v["zone"]) == day}
        _agree(await _report(database_dsn, day, day + timedelta(days=1)), on_day)

    assert (await limiter.store.audit()) == []
    charged = sum(v["charged_tokens"] for v in expected.values())
    money = sum(v["charged_cost"] for v in expected.values())
    print(
        f"FIGURE quota-report: workload {counts}; {len(expected)} windows, {charged} tokens"
        f" and {money} USD charged across quotas, all equal to the ledger"
    )
