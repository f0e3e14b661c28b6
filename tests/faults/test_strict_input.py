"""Strict input over a real uvicorn server: numbers that are JSON numbers of
their kind on every resource, names and models that follow the patterns of
llmquota.domain.names in bodies and paths (and the OpenAPI schema saying
so), and a prepaid tenant's zero-cost request admitted, never an SQLSTATE.

Every refusal is a 422 naming the field and leaves every table as it was.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from decimal import Decimal
from typing import Any

import asyncpg
import httpx
import pytest

from llmquota.admin.alerts import AlertService
from llmquota.admin.service import AdminService
from llmquota.domain.errors import InvalidRequest
from llmquota.domain.names import (
    MODEL_GLOB_PATTERN,
    MODEL_MAX_CHARS,
    MODEL_PATTERN,
    NAME_MAX_CHARS,
    NAME_PATTERN,
)
from llmquota.domain.plans import Ceiling, Plan
from llmquota.domain.policy import Policy
from llmquota.domain.quotas import quota_spec
from llmquota.store.store import Store
from tests.faults.conftest import fault_settings, serving

ADMIN_KEY = "lq_strict_admin_key_0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
ADMIT = {"tenant": "acme", "model": "gpt-4o", "input_tokens": 5, "max_tokens": 5}


@pytest.fixture
async def client(database_dsn: str) -> AsyncIterator[httpx.AsyncClient]:
    """A client of a real uvicorn server (raw percent-encoded paths reach it as sent)."""
    settings = fault_settings(admin_key=ADMIN_KEY, decision_deadline_ms=30_000)
    async with (
        serving(settings, database_dsn) as (url, _app),
        httpx.AsyncClient(base_url=url, headers=ADMIN, timeout=30) as c,
    ):
        yield c


async def fingerprint(db: asyncpg.Connection) -> dict[str, str | None]:
    """A digest of every table's rows: a refused request must change none of them."""
    tables = await db.fetch(
        "SELECT format('%I.%I', schemaname, tablename) AS t FROM pg_tables"
        " WHERE schemaname = 'public' ORDER BY 1"
    )
    return {
        t["t"]: await db.fetchval(
            f"SELECT md5(string_agg(x::text, '|' ORDER BY x::text)) FROM {t['t']} AS x"
        )
        for t in tables
    }


async def acme(client: httpx.AsyncClient) -> None:
    policy = {"tokens_per_minute": 100_000, "max_in_flight": 10}
    assert (await client.put("/v1/tenants/acme/policy", json=policy)).status_code == 200


def with_value(body: dict[str, Any], field: tuple[str | int, ...], value: Any) -> dict[str, Any]:
    """A deep copy of `body` with `value` at `field` (keys and list indexes)."""
    copy: Any = _copy(body)
    target = copy
    for step in field[:-1]:
        target = target[step]
    target[field[-1]] = value
    result: dict[str, Any] = copy
    return result


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


# Integers: a boolean, a string of digits and a fraction are not integers.
NOT_INTEGERS = [True, "100", 1.5]
# Fractions (0, 1]: a boolean and a string of one are not numbers.
NOT_FRACTIONS = [True, "0.5"]
LIMITS = ["tokens_per_minute", "token_burst", "requests_per_minute", "request_burst"]
POLICY = {"tokens_per_minute": 1_000, "requests_per_minute": 100}
FIXED = {"output_estimate": {"strategy": "fixed", "tokens": 10}}
LEARNED = {"output_estimate": {"strategy": "learned", "quantile": 0.9, "min_samples": 5}}
CACHE = {
    "cache": {
        "mode": "semantic",
        "embedding_model": "text-embedding-3-small",
        "ttl_seconds": 60,
        "max_entries": 10,
        "similarity": 0.9,
        "hit_price_usd": "0.0001",
    }
}
CEILING = {
    "models": ["gpt-4o"],
    "tokens_per_minute": 1_000,
    "requests_per_minute": 100,
    "shed": [{"above": 0.8, "admit": ["high"], "small_request_tokens": 10}],
}


def _policy_fields(*extra: str) -> list[tuple[dict[str, Any], tuple[str | int, ...], list[Any]]]:
    """(body, field, bad values) of every number a policy-shaped body holds."""
    cases: list[tuple[dict[str, Any], tuple[str | int, ...], list[Any]]] = [
        (POLICY, (name,), NOT_INTEGERS) for name in [*LIMITS, "max_in_flight", "lease_seconds"]
    ]
    cases += [(POLICY, (name,), NOT_INTEGERS) for name in extra]
    return cases


def _estimate_fields(
    **more: Any,
) -> list[tuple[dict[str, Any], tuple[str | int, ...], list[Any]]]:
    """`more`: what else the body needs (a tenant or route policy of no limit says
    "unlimited": true). The response cache's numbers too."""
    return [
        ({**FIXED, **more}, ("output_estimate", "tokens"), NOT_INTEGERS),
        ({**LEARNED, **more}, ("output_estimate", "min_samples"), NOT_INTEGERS),
        ({**LEARNED, **more}, ("output_estimate", "quantile"), NOT_FRACTIONS),
        ({**CACHE, **more}, ("cache", "ttl_seconds"), NOT_INTEGERS),
        ({**CACHE, **more}, ("cache", "max_entries"), NOT_INTEGERS),
        ({**CACHE, **more}, ("cache", "similarity"), NOT_FRACTIONS),
        # Money is a decimal string: a JSON number (or a boolean) is refused.
        ({**CACHE, **more}, ("cache", "hit_price_usd"), [True, 1, 0.5]),
    ]


# kind: (method, path, [(valid body, field, bad values)]); the valid body is
# sent last, and must pass.
RESOURCES: dict[
    str, tuple[str, str, list[tuple[dict[str, Any], tuple[str | int, ...], list[Any]]]]
] = {
    "global policy": ("PUT", "/v1/policies/global", _policy_fields("shards")),
    "tenant policy": (
        "PUT",
        "/v1/tenants/acme/policy",
        _policy_fields() + _estimate_fields(unlimited=True),
    ),
    "route policy": (
        "PUT",
        "/v1/tenants/acme/routes/chat/policy",
        _policy_fields() + _estimate_fields(unlimited=True),
    ),
    "plan": ("PUT", "/v1/plans/gold", _policy_fields() + _estimate_fields()),
    "ceiling": (
        "PUT",
        "/v1/ceilings/openai",
        [(CEILING, (name,), NOT_INTEGERS) for name in [*LIMITS, "max_in_flight"]]
        + [
            (CEILING, ("shed", 0, "small_request_tokens"), NOT_INTEGERS),
            (CEILING, ("shed", 0, "above"), NOT_FRACTIONS),
        ],
    ),
    "quota": (
        "PUT",
        "/v1/tenants/acme/quotas/daily",
        [
            ({"period": "day", "tokens": 1_000}, ("tokens",), NOT_INTEGERS),
            ({"period": "day", "tokens": 1_000, "alerts": [0.5]}, ("alerts", 0), NOT_FRACTIONS),
            # Money is a decimal string: a JSON number (or a boolean) is refused.
            ({"period": "day", "cost": "10.00"}, ("cost",), [True, 10, 10.5]),
        ],
    ),
    "credits": (
        "POST",
        "/v1/tenants/acme/credits",
        [({"amount": "10.00", "reference": "inv-1"}, ("amount",), [True, 10, 10.5])],
    ),
    "admit": (
        "POST",
        "/v1/admit",
        [
            (ADMIT, (name,), NOT_INTEGERS)
            for name in ["input_tokens", "max_tokens", "lease_seconds", "max_wait_ms"]
        ],
    ),
    "settle": (
        "POST",
        "/v1/reservations/{rid}/settle",
        [
            ({"input_tokens": 5, "output_tokens": 5}, (name,), NOT_INTEGERS)
            for name in ["input_tokens", "output_tokens"]
        ],
    ),
    "heartbeat": (
        "POST",
        "/v1/reservations/{rid}/heartbeat",
        # The fencing token first: the heartbeat it passes moves the generation on.
        [
            ({"lease_generation": 1}, ("lease_generation",), NOT_INTEGERS),
            ({"lease_seconds": 60}, ("lease_seconds",), NOT_INTEGERS),
        ],
    ),
}


@pytest.mark.parametrize("kind", list(RESOURCES))
async def test_numbers_must_be_json_numbers_of_their_kind(
    client: httpx.AsyncClient, db: asyncpg.Connection, kind: str
) -> None:
    method, path, cases = RESOURCES[kind]
    await acme(client)
    if "{rid}" in path:
        admitted = await client.post("/v1/admit", json=ADMIT)
        assert admitted.status_code == 201, admitted.text
        path = path.format(rid=admitted.json()["reservation_id"])
    before = await fingerprint(db)
    refused = 0
    for body, field, values in cases:
        name = str(next(step for step in reversed(field) if isinstance(step, str)))
        for value in values:
            response = await client.request(method, path, json=with_value(body, field, value))
            assert response.status_code == 422, (field, value, response.text)
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error"
            assert name in error["message"], (field, value, error["message"])
            refused += 1
    assert refused == sum(len(values) for _, _, values in cases)
    assert await fingerprint(db) == before
    # Each body the bad values went into is itself valid: the value was refused.
    for body, _field, _values in cases:
        response = await client.request(method, path, json=body)
        assert response.is_success, (kind, body, response.text)
        if kind == "quota":
            await client.delete(path)  # a quota of tokens, then one of cost


async def test_keys_take_no_body_and_webhooks_take_strings_only(
    client: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    before = await fingerprint(db)
    hook = {"url": "http://93.184.216.34:9/hook", "secret": "s" * 16}
    for field, value in (("secret", 1234567890123456), ("url", True), ("tenant", 5)):
        response = await client.put("/v1/webhooks/ops", json={**hook, field: value})
        assert response.status_code == 422, (field, response.text)
        assert field in response.json()["error"]["message"]
    assert await fingerprint(db) == before
    assert (await client.put("/v1/webhooks/ops", json=hook)).status_code == 201
    # Keys: the only input is the tenant in the path (checked below, with the names).
    assert (await client.post("/v1/tenants/acme/keys")).status_code == 201


def encoded(name: str) -> str:
    """`name` as a path segment with every byte percent-encoded: `..` reaches the
    server as two dots (not a parent directory), a newline as a newline."""
    return "".join(f"%{byte:02X}" for byte in name.encode())


BAD_NAMES = {
    "dot-dot": "..",
    "leading dot": ".x",
    "129 chars": "a" * (NAME_MAX_CHARS + 1),
    "slash": "a/b",
    "newline": "acme\nforged",
    "escape": "a\x1b[2J",
    "space": "a b",
    "colon": "a:b",
    "non-ascii": "acmé",
}
# A valid name at the limit, with every character the pattern allows.
NAME_128 = ("Ab9-_." * 22)[:NAME_MAX_CHARS]
WEBHOOK = {"url": "http://93.184.216.34:9/hook", "secret": "s" * 16}
QUOTA = {"period": "day", "tokens": 1_000}


def _name_paths(name: str) -> list[tuple[str, str, dict[str, Any] | None, str]]:
    """(method, path, body, the parameter it names) of every path holding a name."""
    n = encoded(name)
    return [
        ("PUT", f"/v1/tenants/{n}/policy", {}, "tenant"),
        ("POST", f"/v1/tenants/{n}/keys", None, "tenant"),
        ("GET", f"/v1/tenants/{n}/status", None, "tenant"),
        ("PUT", f"/v1/tenants/acme/routes/{n}/policy", {}, "route"),
        ("PUT", f"/v1/plans/{n}", {}, "plan"),
        ("PUT", f"/v1/ceilings/{n}", {"models": ["gpt-4o"], "tokens_per_minute": 10}, "ceiling"),
        ("PUT", f"/v1/tenants/acme/quotas/{n}", QUOTA, "name"),
        ("PUT", f"/v1/tenants/acme/routes/{n}/quotas/daily", QUOTA, "route"),
        ("PUT", f"/v1/webhooks/{n}", WEBHOOK, "name"),
    ]


def _name_bodies(name: str) -> list[tuple[str, str, dict[str, Any], str]]:
    """(method, path, body, field) of every body field holding a name."""
    return [
        ("POST", "/v1/admit", {**ADMIT, "tenant": name}, "tenant"),
        ("POST", "/v1/admit", {**ADMIT, "route": name}, "route"),
        ("PUT", "/v1/tenants/acme/policy", {"plan": name}, "plan"),
        ("PUT", "/v1/webhooks/ops", {**WEBHOOK, "tenant": name}, "tenant"),
    ]


@pytest.mark.parametrize("case", list(BAD_NAMES))
async def test_names_outside_the_pattern_are_422_in_paths_and_bodies(
    client: httpx.AsyncClient, db: asyncpg.Connection, case: str
) -> None:
    name = BAD_NAMES[case]
    await acme(client)
    before = await fingerprint(db)
    for method, path, body, param in _name_paths(name):
        response = await client.request(method, path, json=body)
        if "/" in name:
            # The server decodes %2F before routing: a/b is two segments, no route.
            assert response.status_code == 404, (path, response.text)
            continue
        assert response.status_code == 422, (path, response.text)
        assert f"path.{param}" in response.json()["error"]["message"], response.text
    for method, path, body, field in _name_bodies(name):
        response = await client.request(method, path, json=body)
        assert response.status_code == 422, (path, field, response.text)
        assert field in response.json()["error"]["message"], response.text
    assert await fingerprint(db) == before


async def test_a_name_of_128_characters_is_accepted_everywhere(
    client: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    n = NAME_128
    assert len(n) == NAME_MAX_CHARS
    seg = encoded(n)
    assert (await client.put(f"/v1/plans/{seg}", json={"tokens_per_minute": 10})).status_code == 200
    put = await client.put(f"/v1/tenants/{seg}/policy", json={"plan": n, "max_in_flight": 5})
    assert put.status_code == 200, put.text
    assert (await client.post(f"/v1/tenants/{seg}/keys")).status_code == 201
    route = await client.put(f"/v1/tenants/{seg}/routes/{seg}/policy", json={"max_in_flight": 2})
    assert route.status_code == 200, route.text
    ceiling = {"models": ["gpt-4o"], "tokens_per_minute": 1_000}
    assert (await client.put(f"/v1/ceilings/{seg}", json=ceiling)).status_code == 200
    assert (await client.put(f"/v1/tenants/{seg}/quotas/{seg}", json=QUOTA)).status_code == 201
    quota = await client.put(f"/v1/tenants/{seg}/routes/{seg}/quotas/{seg}", json=QUOTA)
    assert quota.status_code == 201, quota.text
    hook = await client.put(f"/v1/webhooks/{seg}", json={**WEBHOOK, "tenant": n})
    assert hook.status_code == 201, hook.text
    admitted = await client.post("/v1/admit", json={**ADMIT, "tenant": n, "route": n})
    assert admitted.status_code == 201, admitted.text
    assert (await client.get(f"/v1/tenants/{seg}/status")).status_code == 200
    stored = await db.fetchrow("SELECT tenant, route FROM reservations")
    assert (stored["tenant"], stored["route"]) == (n, n)
    assert await db.fetchval("SELECT count(*) FROM quotas WHERE name = $1", n) == 2


async def test_the_openapi_schema_shows_the_patterns(client: httpx.AsyncClient) -> None:
    schema = (await client.get("/openapi.json")).json()
    for path, param in (
        ("/v1/tenants/{tenant}/policy", "tenant"),
        ("/v1/tenants/{tenant}/routes/{route}/policy", "route"),
        ("/v1/plans/{plan}", "plan"),
        ("/v1/ceilings/{ceiling}", "ceiling"),
        ("/v1/webhooks/{name}", "name"),
    ):
        (parameter,) = [p for p in schema["paths"][path]["put"]["parameters"] if p["name"] == param]
        assert parameter["schema"]["pattern"] == NAME_PATTERN, path
        assert parameter["schema"]["maxLength"] == NAME_MAX_CHARS, path
    components = schema["components"]["schemas"]
    admit = components["AdmitBody"]["properties"]
    assert admit["tenant"]["pattern"] == NAME_PATTERN
    assert admit["tenant"]["maxLength"] == NAME_MAX_CHARS
    assert admit["model"]["pattern"] == MODEL_PATTERN
    assert admit["model"]["maxLength"] == MODEL_MAX_CHARS
    assert admit["max_tokens"]["type"] == "integer"
    ceiling_models = components["Ceiling"]["properties"]["models"]["items"]
    assert ceiling_models["pattern"] == MODEL_GLOB_PATTERN


BAD_MODELS = {
    "space": "gpt 4o",
    "newline": "gpt-4o\nforged",
    "carriage return": "gpt-4o\r",
    "escape": "gpt-4o\x1b[2J",
    "NUL": "gpt-4o\x00",
    "formula": '=HYPERLINK("http://x","y")',
    "201 chars": "m" * (MODEL_MAX_CHARS + 1),
    "non-ascii": "gpt-4ö",
}


def _embedding(model: str, **more: Any) -> dict[str, Any]:
    """A policy whose semantic response cache embeds with `model`, and `more`."""
    return {**more, "cache": {"mode": "semantic", "embedding_model": model}}


async def test_models_outside_the_pattern_are_422_and_change_nothing(
    client: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    await acme(client)
    before = await fingerprint(db)
    for model in [*BAD_MODELS.values(), "gpt-4o*"]:  # a glob is no model to admit
        attempts = [
            ("POST", "/v1/admit", {**ADMIT, "model": model}, "model"),
            ("POST", "/v1/admit", {**ADMIT, "fallback_models": [model]}, "fallback_models"),
            ("PUT", "/v1/tenants/acme/policy", {"fallback_models": [model]}, "fallback_models"),
            ("PUT", "/v1/plans/gold", {"fallback_models": [model]}, "fallback_models"),
            ("PUT", "/v1/plans/gold", _embedding(model), "embedding_model"),
            (
                "PUT",
                "/v1/tenants/acme/policy",
                _embedding(model, unlimited=True),
                "embedding_model",
            ),
        ]
        if model != "gpt-4o*":
            attempts += [
                ("PUT", "/v1/ceilings/c", {"models": [model], "tokens_per_minute": 9}, "models"),
                ("PUT", "/v1/tenants/acme/quotas/q", {**QUOTA, "models": [model]}, "models"),
            ]
        for method, path, body, field in attempts:
            response = await client.request(method, path, json=body)
            assert response.status_code == 422, (repr(model), path, response.text)
            assert field in response.json()["error"]["message"], response.text
    assert await fingerprint(db) == before
    # Every character the pattern allows, in one name; and globs where globs belong.
    model = "ft:gpt-4o-mini:org/team@2024_v1.2"
    admitted = await client.post("/v1/admit", json={**ADMIT, "model": model})
    assert admitted.status_code == 201, admitted.text
    assert admitted.json()["model"] == model
    ceiling = {"models": ["gpt-4o-2024-*"], "tokens_per_minute": 9}
    assert (await client.put("/v1/ceilings/c", json=ceiling)).status_code == 200
    glob = {**QUOTA, "models": ["gpt-4o*"]}
    assert (await client.put("/v1/tenants/acme/quotas/q", json=glob)).status_code == 201


async def test_a_prepaid_tenant_without_credits_is_admitted_for_nothing(
    client: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    """No top-up ever, so no credit account: a request that costs 0 (a free model,
    or no tokens at all) is admitted and settled; one that costs anything is 402."""
    await db.execute(
        "INSERT INTO model_prices (model, effective_from, input_usd_per_million,"
        " output_usd_per_million) VALUES ('free-model', '2020-01-01', 0, 0),"
        " ('gpt-4o', '2020-01-01', 2.50, 10.00)"
    )
    policy = {"tokens_per_minute": 100_000, "prepaid": True}
    assert (await client.put("/v1/tenants/acme/policy", json=policy)).status_code == 200
    assert await db.fetchval("SELECT count(*) FROM credit_accounts") == 0

    free = await client.post("/v1/admit", json={**ADMIT, "model": "free-model", "max_tokens": 100})
    assert free.status_code == 201, free.text
    nothing = await client.post("/v1/admit", json={**ADMIT, "input_tokens": 0, "max_tokens": 0})
    assert nothing.status_code == 201, nothing.text
    assert nothing.json()["reserved_tokens"] == 0
    held = await db.fetch("SELECT model, credit_reserved FROM reservations ORDER BY model")
    assert [(r["model"], r["credit_reserved"]) for r in held] == [
        ("free-model", Decimal(0)),
        ("gpt-4o", Decimal(0)),
    ]
    priced = await client.post("/v1/admit", json={**ADMIT, "input_tokens": 1, "max_tokens": 0})
    assert priced.status_code == 402, priced.text
    assert priced.json()["error"]["type"] == "credits_exhausted"

    for admitted, usage in ((free, (40, 60)), (nothing, (0, 0))):
        rid = admitted.json()["reservation_id"]
        settled = await client.post(
            f"/v1/reservations/{rid}/settle",
            json={"input_tokens": usage[0], "output_tokens": usage[1]},
        )
        assert settled.status_code == 200, settled.text
    account = await db.fetchrow("SELECT balance, reserved FROM credit_accounts")
    assert (account["balance"], account["reserved"]) == (0, 0)
    charges = await db.fetch("SELECT amount FROM credit_ledger WHERE entry_kind = 'charge'")
    assert sorted(r["amount"] for r in charges) == [0, 0]
    ledger = await db.fetch("SELECT input_tokens, output_tokens FROM usage_ledger ORDER BY 1")
    assert [(r["input_tokens"], r["output_tokens"]) for r in ledger] == [(0, 0), (40, 60)]


async def test_the_admin_services_refuse_bad_names_from_any_caller(
    database_dsn: str, db: asyncpg.Connection
) -> None:
    """What the library (or a future command) calls directly checks the same patterns."""
    admin = await AdminService.connect(database_dsn)
    store = await Store.connect(database_dsn, min_size=1, max_size=1)
    alerts = AlertService(store)
    spec = quota_spec(period="day", tokens=10)
    hook = ("http://127.0.0.1:9/", "s" * 16)
    calls: list[tuple[Callable[[], Awaitable[object]], str]] = [
        (lambda: admin.put_plan("..", Plan()), "plan"),
        (lambda: admin.put_ceiling(".x", Ceiling(models=["gpt-4o"])), "ceiling"),
        (lambda: admin.create_key("a\nb"), "tenant"),
        (lambda: admin.put_policy("route", "acme", "a/b", Policy()), "route"),
        (lambda: admin.put_tenant_policy("acme", "a b", {}), "plan"),
        (lambda: alerts.put_quota("acme", None, "a:b", spec), "name"),
        (lambda: alerts.put_webhook("ops", *hook, ".."), "tenant"),
    ]
    before = await fingerprint(db)
    try:
        for call, field in calls:
            with pytest.raises(InvalidRequest, match=f"^{field} must be ASCII letters"):
                await call()
    finally:
        await admin.close()
        await store.close()
    assert await fingerprint(db) == before
