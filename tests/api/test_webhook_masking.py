"""GET /v1/webhooks shows a URL's embedded credentials masked; deliveries keep them."""

from __future__ import annotations

import asyncpg
import httpx

SECRET = "whsec_0123456789abcdef"
URL = "https://hook:s3cr3t-pass@93.184.216.34/in?team=ops&token=tok123&api_key=k9&x=1"
SHOWN = "https://hook:***@93.184.216.34/in?team=ops&token=***&api_key=***&x=1"


async def test_credentials_in_webhook_urls_are_masked_when_shown(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection
) -> None:
    put = await client.put("/v1/webhooks/ops", json={"url": URL, "secret": SECRET}, headers=admin)
    assert put.status_code == 201, put.text
    assert put.json()["url"] == SHOWN
    listed = await client.get("/v1/webhooks", headers=admin)
    assert [hook["url"] for hook in listed.json()["webhooks"]] == [SHOWN]
    for secret in ("s3cr3t-pass", "tok123", "k9&"):
        assert secret not in listed.text
    assert (await client.get("/v1/webhooks/ops", headers=admin)).json()["url"] == SHOWN
    # Stored whole: the deliveries still authenticate to the receiver.
    assert await db.fetchval("SELECT url FROM webhooks WHERE name = 'ops'") == URL
