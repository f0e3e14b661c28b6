"""GET /v1/tenants (keyset pages) and DELETE /v1/tenants/{t}, through the real app."""

from __future__ import annotations

import asyncpg
import httpx

from tests.api.conftest import make_tenant
from tests.conftest import audit_findings


async def test_pages_walk_every_tenant_once_in_name_order(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    names = [f"t{n:02d}" for n in range(7)]
    for name in reversed(names):
        await make_tenant(client, admin, name, tokens_per_minute=1_000)
    seen: list[str] = []
    cursor: str | None = None
    pages = 0
    while True:
        params: dict[str, str | int] = {"limit": 3}
        if cursor is not None:
            params["cursor"] = cursor
        page = await client.get("/v1/tenants", params=params, headers=admin)
        assert page.status_code == 200, page.text
        body = page.json()
        pages += 1
        assert len(body["tenants"]) <= 3
        seen += [t["tenant"] for t in body["tenants"]]
        cursor = body["next_cursor"]
        if cursor is None:
            break
    assert seen == names
    assert pages == 3  # 3 + 3 + 1
    first = (await client.get("/v1/tenants", headers=admin)).json()
    assert len(first["tenants"]) == 7  # default limit 100
    assert first["next_cursor"] is None
    assert first["tenants"][0] == {
        "tenant": "t00",
        "plan": None,
        "status": "active",
        "last_activity_at": None,
    }
    suspended = await client.post("/v1/tenants/t01/suspend", headers=admin)
    assert suspended.is_success, suspended.text
    statuses = {
        t["tenant"]: t["status"]
        for t in (await client.get("/v1/tenants", headers=admin)).json()["tenants"]
    }
    assert statuses["t01"] == "suspended" and statuses["t00"] == statuses["t02"] == "active"


async def test_plan_filter_and_last_activity(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    await client.put("/v1/plans/pro", json={"tokens_per_minute": 60_000}, headers=admin)
    await client.put("/v1/tenants/acme/policy", json={"plan": "pro"}, headers=admin)
    await make_tenant(client, admin, "other", tokens_per_minute=1_000)
    key = (await client.post("/v1/tenants/acme/keys", headers=admin)).json()["key"]
    admitted = await client.post(
        "/v1/admit",
        json={"tenant": "acme", "model": "gpt-4o", "input_tokens": 5, "max_tokens": 5},
        headers={"Authorization": f"Bearer {key}"},
    )
    assert admitted.status_code == 201
    page = await client.get("/v1/tenants", params={"plan": "pro"}, headers=admin)
    tenants = page.json()["tenants"]
    assert [t["tenant"] for t in tenants] == ["acme"]
    assert tenants[0]["plan"] == "pro"
    assert tenants[0]["last_activity_at"] is not None
    none = await client.get("/v1/tenants", params={"plan": "free"}, headers=admin)
    assert none.json() == {"tenants": [], "next_cursor": None}


async def test_bad_limit_or_cursor_is_422_and_tenants_may_not_list(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    acme = await make_tenant(client, admin, "acme", tokens_per_minute=1_000)
    for limit in (0, 1001, "x"):
        bad = await client.get("/v1/tenants", params={"limit": limit}, headers=admin)
        assert bad.status_code == 422, limit
        assert "limit" in bad.json()["error"]["message"]
    for cursor in ("!!!", "Lg", "-_-_"):  # not base64, ".", undecodable bytes
        bad = await client.get("/v1/tenants", params={"cursor": cursor}, headers=admin)
        assert bad.status_code == 422, cursor
        assert "cursor" in bad.json()["error"]["message"]
    for plan in ("F\x00x", "", ".hidden", "x" * 129):  # a NUL was a bare SQLSTATE 22021
        bad = await client.get("/v1/tenants", params={"plan": plan}, headers=admin)
        assert bad.status_code == 422, plan
        assert "plan" in bad.json()["error"]["message"]
    assert (await client.get("/v1/tenants", headers=acme)).status_code == 403


async def test_delete_refuses_while_reservations_are_active_then_removes_all_but_the_ledger(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection
) -> None:
    acme = await make_tenant(client, admin, "acme", tokens_per_minute=60_000)
    await client.put(
        "/v1/tenants/acme/routes/chat/policy", json={"max_in_flight": 3}, headers=admin
    )
    ids = []
    for _ in range(2):
        admitted = await client.post(
            "/v1/admit",
            json={"tenant": "acme", "model": "gpt-4o", "input_tokens": 5, "max_tokens": 5},
            headers=acme,
        )
        assert admitted.status_code == 201
        ids.append(admitted.json()["reservation_id"])
    refused = await client.delete("/v1/tenants/acme", headers=admin)
    assert refused.status_code == 409
    assert refused.json()["error"]["active_reservations"] == 2
    assert "2 active reservations" in refused.json()["error"]["message"]
    settled = await client.post(
        f"/v1/reservations/{ids[0]}/settle",
        json={"input_tokens": 5, "output_tokens": 3},
        headers=acme,
    )
    assert settled.status_code == 200, settled.text
    await client.post(f"/v1/reservations/{ids[1]}/release", headers=acme)
    ledger_before = await db.fetch("SELECT * FROM usage_ledger WHERE tenant = 'acme' ORDER BY 1")
    assert len(ledger_before) >= 1

    deleted = await client.delete("/v1/tenants/acme", headers=admin)
    assert deleted.status_code == 204
    assert await db.fetchval("SELECT count(*) FROM tenants WHERE tenant = 'acme'") == 0
    assert await db.fetchval("SELECT count(*) FROM limit_layers WHERE tenant = 'acme'") == 0
    assert await db.fetchval("SELECT count(*) FROM api_keys WHERE tenant = 'acme'") == 0
    ledger_after = await db.fetch("SELECT * FROM usage_ledger WHERE tenant = 'acme' ORDER BY 1")
    assert ledger_after == ledger_before
    assert (await client.get("/v1/tenants/acme/policy", headers=admin)).status_code == 404
    # Its key no longer authenticates.
    assert (await client.get("/v1/tenants/acme/status", headers=acme)).status_code == 401
    again = await client.delete("/v1/tenants/acme", headers=admin)
    assert again.status_code == 404


async def test_delete_honours_if_match(client: httpx.AsyncClient, admin: dict[str, str]) -> None:
    put = await client.put("/v1/tenants/acme/policy", json={"max_in_flight": 2}, headers=admin)
    etag = put.headers["etag"]
    await client.patch(
        "/v1/tenants/acme/policy",
        json={"max_in_flight": 3},
        headers={**admin, "content-type": "application/merge-patch+json"},
    )
    stale = await client.delete("/v1/tenants/acme", headers={**admin, "if-match": etag})
    assert stale.status_code == 412
    current = (await client.get("/v1/tenants/acme/policy", headers=admin)).headers["etag"]
    ok = await client.delete("/v1/tenants/acme", headers={**admin, "if-match": current})
    assert ok.status_code == 204


async def test_delete_closes_a_credit_balance_out_in_the_credit_ledger(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection, database_dsn: str
) -> None:
    """The credit ledger keeps its rows: a deleted tenant's balance is closed out by
    one adjustment, so the ledger still sums to each account and a tenant created
    later under the same name starts from a zero balance (its references stay
    taken, as the payments they name were made)."""
    await make_tenant(client, admin, "acme", tokens_per_minute=60_000)
    topup = await client.post(
        "/v1/tenants/acme/credits", json={"amount": "22.9272", "reference": "inv-1"}, headers=admin
    )
    assert topup.status_code == 201, topup.text
    assert (await client.delete("/v1/tenants/acme", headers=admin)).status_code == 204
    rows = await db.fetch(
        "SELECT entry_kind, amount, balance_after FROM credit_ledger"
        " WHERE tenant = 'acme' ORDER BY entry_id"
    )
    assert [(r["entry_kind"], str(r["amount"]), str(r["balance_after"])) for r in rows] == [
        ("topup", "22.9272", "22.9272"),
        ("adjustment", "-22.9272", "0"),
    ]
    await make_tenant(client, admin, "acme", tokens_per_minute=60_000)
    # A reference names one payment of that tenant name, deleted or not: the
    # old one answers as the top-up it was (applied false), and adds nothing.
    reused = await client.post(
        "/v1/tenants/acme/credits", json={"amount": "22.9272", "reference": "inv-1"}, headers=admin
    )
    assert reused.status_code == 200, reused.text
    assert (reused.json()["applied"], reused.json()["balance"]) == (False, "0")
    again = await client.post(
        "/v1/tenants/acme/credits", json={"amount": "1.5", "reference": "inv-2"}, headers=admin
    )
    assert again.status_code == 201, again.text
    credits = (await client.get("/v1/tenants/acme/credits", headers=admin)).json()
    assert credits["balance"] == "1.5"
    assert await audit_findings(database_dsn) == []
