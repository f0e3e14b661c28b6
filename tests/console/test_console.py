"""The console in a real headless Chromium, against a real server process.

What a person would check: a tenant's key (or a wrong one) does not open
it; the figures it shows are the API's; revoking a key in the page makes
that key fail over the API; the chart shows every decision made. Each test
writes its screenshot to docs/console/.
"""

from __future__ import annotations

import asyncio
import math

import asyncpg
import httpx
import pytest
from playwright.async_api import Page

from tests.console.conftest import (
    ADMIN_KEY,
    cells,
    new_key,
    put,
    screenshot,
    sign_in,
    submit_key,
)
from tests.faults.conftest import wait_for
from tests.receiver import Receiver
from tests.support import run_cli

# Debian's chromium is not on a machine with only Python: `.ci/run` installs
# it and runs these with `pytest -m 'pgbouncer or browser'`.
pytestmark = pytest.mark.browser

ADMIT = {"model": "gpt-4o", "max_tokens": 0}


async def admit(
    api: httpx.AsyncClient, key: str, tenant: str, tokens: int, **extra: str
) -> httpx.Response:
    return await api.post(
        "/v1/admit",
        json={**ADMIT, "tenant": tenant, "input_tokens": tokens, **extra},
        headers={"Authorization": f"Bearer {key}"},
    )


async def test_a_tenant_key_or_a_wrong_key_cannot_sign_in_and_an_admin_key_can(
    page: Page, base_url: str, api: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    await put(api, "/v1/tenants/acme/policy", {"unlimited": True}, admin)
    _, tenant_key = await new_key(api, "acme", admin)

    assert await sign_in(page, base_url, tenant_key) == 401
    assert page.url.endswith("/console/login")
    assert "only an admin key" in await page.inner_text("[data-testid=sign-in-error]")
    await screenshot(page, "sign-in-refused")
    assert await sign_in(page, base_url, "lq_not_a_key_at_all_0123456789") == 401
    assert "not valid" in await page.inner_text("[data-testid=sign-in-error]")
    cookies = await page.context.cookies()
    assert "lq_console" not in {c["name"] for c in cookies}

    # From the refusal's own page: it shows the form again, not its text.
    assert await submit_key(page, ADMIN_KEY) == 303
    assert page.url == f"{base_url}/console"
    session = next(c for c in await page.context.cookies() if c["name"] == "lq_console")
    assert session["httpOnly"] is True
    assert session["sameSite"] == "Strict"
    assert ADMIN_KEY not in session["value"]
    assert session["path"] == "/console"


async def test_posts_without_the_csrf_token_are_refused_and_change_nothing(
    page: Page, base_url: str, api: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    await put(api, "/v1/tenants/acme/policy", {"unlimited": True}, admin)
    key_id, key = await new_key(api, "acme", admin)
    assert await sign_in(page, base_url, ADMIN_KEY) == 303
    session = {c["name"]: c["value"] for c in await page.context.cookies()}
    form = {"content-type": "application/x-www-form-urlencoded"}

    async with httpx.AsyncClient(base_url=base_url, cookies=session) as browserless:
        revoke = f"/console/tenants/acme/keys/{key_id}/revoke"
        assert (await browserless.post(revoke, content=b"", headers=form)).status_code == 403
        forged = b"csrf_token=forged"
        assert (await browserless.post(revoke, content=forged, headers=form)).status_code == 403
        out = await browserless.post("/console/logout", content=b"", headers=form)
        assert out.status_code == 403
        # Sign-in has a token of its own (double-submit): a bare POST is refused too.
        bare = await browserless.post("/console/login", content=b"key=x", headers=form)
        assert bare.status_code == 403

    # The key still works and the session is still open.
    status = await api.get("/v1/tenants/acme/status", headers={"Authorization": f"Bearer {key}"})
    assert status.status_code == 200
    await page.goto(f"{base_url}/console/tenants/acme")
    assert page.url.endswith("/console/tenants/acme")
    # Signing out through the page's own form works, and ends the session.
    await page.click("[data-testid=sign-out]")
    assert page.url.endswith("/console/login")
    await page.goto(f"{base_url}/console")
    assert page.url.endswith("/console/login")


async def test_the_tenant_page_shows_the_apis_balances_and_revoke_works(
    page: Page, base_url: str, api: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    # One token a minute: the balance a test sees moves by at most one.
    policy = {"tokens_per_minute": 1, "token_burst": 10_000, "max_in_flight": 5}
    await put(api, "/v1/tenants/acme/policy", policy, admin)
    quota = {"period": "day", "tokens": 50_000, "alerts": [0.9]}
    await put(api, "/v1/tenants/acme/quotas/daily", quota, admin)
    key_id, key = await new_key(api, "acme", admin, label="<script>alert(1)</script>")
    other_id, _ = await new_key(api, "acme", admin, label="batch")
    for tokens in (3_000, 1_200):
        assert (await admit(api, key, "acme", tokens)).status_code == 201
    assert (await admit(api, key, "acme", 9_000)).status_code == 429
    topup = {"amount": "12.50", "reference": "invoice-1"}
    assert (await api.post("/v1/tenants/acme/credits", json=topup, headers=admin)).is_success
    bearer = {"Authorization": f"Bearer {key}"}
    before = (await api.get("/v1/tenants/acme/status", headers=admin)).json()

    assert await sign_in(page, base_url, ADMIN_KEY) == 303
    await page.goto(f"{base_url}/console/tenants/acme")
    after = (await api.get("/v1/tenants/acme/status", headers=admin)).json()
    shown = {row[0]: row for row in await cells(page, "layers")}
    tenant_before = next(layer for layer in before["layers"] if layer["scope"] == "tenant")
    tenant_after = next(layer for layer in after["layers"] if layer["scope"] == "tenant")
    assert int(shown["tenant"][2]) in {
        tenant_before["remaining_tokens"],
        tenant_after["remaining_tokens"],
    }
    assert 5_800 <= int(shown["tenant"][2]) <= 5_802  # refills one a minute
    assert int(shown["tenant"][3]) == tenant_after["limits"]["token_burst"] == 10_000
    assert int(shown["tenant"][7]) == tenant_after["in_flight"] == 2
    window = (await api.get("/v1/tenants/acme/quotas/daily", headers=admin)).json()["window"]
    name, _, period, limit, _, used = (await cells(page, "quotas"))[0][:6]
    assert (name, period, int(limit)) == ("daily", "day", 50_000)
    assert int(used) == window["usage_tokens"]
    credits = (await api.get("/v1/tenants/acme/credits", headers=admin)).json()
    assert (await cells(page, "credits"))[0][0] == credits["balance"] == "12.5"
    assert (await cells(page, "credit-ledger"))[0][2] == "invoice-1"
    # A label is shown as the text it is, never run.
    labels = [row[2] for row in await cells(page, "keys")]
    assert "<script>alert(1)</script>" in labels
    await wait_for(lambda: _refusals_shown(page), 30)
    await screenshot(page, "tenant")

    await page.click(f"[data-testid=revoke-{key_id}]")
    assert page.url.endswith("/console/tenants/acme")
    assert (await api.get("/v1/tenants/acme/status", headers=bearer)).status_code == 401
    keys = {row[0]: row for row in await cells(page, "keys")}
    assert keys[str(key_id)][7] != "-"  # revoked at
    assert keys[str(other_id)][7] == "-"
    listed = (await api.get("/v1/tenants/acme/keys", headers=admin)).json()
    assert [k["id"] for k in listed if k["revoked_at"] is not None] == [key_id]


async def _refusals_shown(page: Page) -> bool:
    """The tenant page, reloaded, lists the one refusal (once the worker flushed it)."""
    await page.reload()
    rows = await cells(page, "refusals")
    return [row[1:] for row in rows] == [["tenant_tokens", "1"]]


async def test_the_overview_shows_the_apis_ceilings_and_usage_and_charts_every_decision(
    page: Page,
    base_url: str,
    api: httpx.AsyncClient,
    admin: dict[str, str],
    owner_dsn: str,
) -> None:
    ceiling = {
        "models": ["gpt-4o"],
        "tokens_per_minute": 1,
        "token_burst": 10_000,
        "shed": [{"above": 0.5, "admit": ["high", "critical"]}],
    }
    await put(api, "/v1/ceilings/openai", ceiling, admin)
    await put(api, "/v1/policies/global", {"tokens_per_minute": 1, "token_burst": 50_000}, admin)
    prices = ("prices", "set", "--model", "gpt-4o*", "--input-per-million", "2.50")
    prices += ("--output-per-million", "10", "--set-by", "alice")
    await asyncio.to_thread(run_cli, *prices, dsn=owner_dsn)
    await put(api, "/v1/tenants/acme/policy", {"tokens_per_minute": 100_000}, admin)
    await put(api, "/v1/tenants/zeta/policy", {"tokens_per_minute": 100_000}, admin)
    _, acme = await new_key(api, "acme", admin)
    _, zeta = await new_key(api, "zeta", admin)
    # Below the ladder's 0.5 each: 3,000 then 1,000 reserved, 2,500 and 150 used.
    uses = (("acme", acme, 3_000, 2_000, 500), ("zeta", zeta, 1_000, 100, 50))
    for tenant, key, reserve, input_tokens, output_tokens in uses:
        admitted = await admit(api, key, tenant, reserve)
        assert admitted.status_code == 201, admitted.text
        settled = await api.post(
            f"/v1/reservations/{admitted.json()['reservation_id']}/settle",
            json={"input_tokens": input_tokens, "output_tokens": output_tokens, "outcome": "ok"},
            headers=admin,
        )
        assert settled.status_code == 200, settled.text
    # The ceiling holds 10,000 - 2,650 used: a critical admission (only the admin
    # may raise a priority) of 3,350 leaves 60% in use, above the ladder's 0.5,
    # where normal requests are shed.
    held = await admit(api, ADMIN_KEY, "acme", 3_350, priority="critical")
    assert held.status_code == 201
    refused = [await admit(api, zeta, "zeta", 500) for _ in range(3)]
    assert {r.status_code for r in refused} == {429}

    assert await sign_in(page, base_url, ADMIN_KEY) == 303
    await wait_for(lambda: _chart_counts(page, {"admitted": 3, "refused": 3}), 30)
    api_ceiling = (await api.get("/v1/ceilings/openai", headers=admin)).json()
    row = (await cells(page, "ceilings"))[0]
    assert row[0] == "openai"
    shown = float(row[2].rstrip("%"))
    assert math.isclose(shown, api_ceiling["utilization"] * 100, abs_tol=0.05)
    assert 59.9 <= shown <= 60.0
    assert row[6] == "above 0.5: only high, critical"
    top = {r[0]: r for r in await cells(page, "top-tenants")}
    for tenant in ("acme", "zeta"):
        usage = (await api.get(f"/v1/tenants/{tenant}/usage", headers=admin)).json()
        assert int(top[tenant][2]) == usage["input_tokens"] + usage["output_tokens"]
    assert [r[0] for r in await cells(page, "top-tenants")] == ["acme", "zeta"]
    assert int(top["acme"][2]) == 2_500
    # 2,000 in and 500 out at 2.50 and 10 per million; 100 and 50.
    assert [top["acme"][3], top["zeta"][3]] == ["0.01", "0.00075"]
    status = (await api.get("/v1/tenants/acme/status", headers=admin)).json()
    shared = next(layer for layer in status["layers"] if layer["scope"] == "global")
    global_row = (await cells(page, "global-layer"))[0]
    assert abs(int(global_row[2]) - shared["remaining_tokens"]) <= 1  # refills 1 a minute
    assert int(global_row[3]) == shared["limits"]["token_burst"] == 50_000
    assert int(global_row[7]) == shared["in_flight"] == 1

    bars = page.locator("[data-testid=decisions-chart] rect.bar")
    db = await asyncpg.connect(owner_dsn)
    try:
        groups = await db.fetchval(
            "SELECT count(DISTINCT (minute, outcome)) FROM decision_counts WHERE decisions > 0"
        )
    finally:
        await db.close()
    assert await bars.count() == groups
    await screenshot(page, "overview")


async def _chart_counts(page: Page, expected: dict[str, int]) -> bool:
    """The overview, reloaded, charts exactly these decisions per outcome."""
    await page.reload()
    bars = page.locator("[data-testid=decisions-chart] rect.bar")
    totals: dict[str, int] = {}
    for i in range(await bars.count()):
        bar = bars.nth(i)
        outcome = await bar.get_attribute("data-outcome") or ""
        totals[outcome] = totals.get(outcome, 0) + int(await bar.get_attribute("data-count") or 0)
    return totals == expected


async def test_the_alerts_page_shows_each_alert_with_its_webhook_delivery_state(
    page: Page, base_url: str, api: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    receiver = await Receiver().start()
    try:
        await put(api, "/v1/tenants/acme/policy", {"unlimited": True}, admin)
        hook = {"url": receiver.url, "secret": "s3cret-s3cret-s3cret-s3cret"}
        await put(api, "/v1/webhooks/ops", hook, admin)
        quota = {"period": "day", "tokens": 1_000, "alerts": [0.5]}
        await put(api, "/v1/tenants/acme/quotas/daily", quota, admin)
        _, key = await new_key(api, "acme", admin)
        admitted = await admit(api, key, "acme", 100)
        assert admitted.status_code == 201, admitted.text
        settled = await api.post(
            f"/v1/reservations/{admitted.json()['reservation_id']}/settle",
            json={"input_tokens": 500, "output_tokens": 100, "outcome": "ok"},
            headers={"Authorization": f"Bearer {key}"},
        )
        assert settled.status_code == 200, settled.text

        async def delivered() -> bool:
            alerts = (await api.get("/v1/tenants/acme/alerts", headers=admin)).json()["alerts"]
            return [a["deliveries"]["delivered"] for a in alerts] == [1]

        await wait_for(delivered, 30)
        listed = (await api.get("/v1/tenants/acme/alerts", headers=admin)).json()["alerts"]
        assert await sign_in(page, base_url, ADMIN_KEY) == 303
        await page.goto(f"{base_url}/console/alerts")
        rows = await cells(page, "alerts")
        assert len(rows) == 1
        tenant, _, kind, subject, threshold, usage, limit = rows[0][:7]
        assert (tenant, kind, threshold, limit) == ("acme", listed[0]["type"], "0.5", "1000")
        assert usage == listed[0]["usage"] == "600"
        assert subject == listed[0]["subject"]
        assert rows[0][7:] == ["1", "1", "0", "0"]  # deliveries, delivered, gave up, pending
        assert [row[0] for row in await cells(page, "webhooks")] == ["ops"]
        assert len(receiver.delivered()) == 1
        await screenshot(page, "alerts")
    finally:
        await receiver.stop()
