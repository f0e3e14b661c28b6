"""Console sessions over plain HTTP against the real server: what the cookie
holds, and what ends a session (signing out, revoking the admin key that
opened it). The browser tests prove the same forms in Chromium."""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator

import httpx

from tests.console.conftest import ADMIN_KEY

FORM = {"content-type": "application/x-www-form-urlencoded"}


@contextlib.asynccontextmanager
async def _signed_in(
    base_url: str, key: str
) -> AsyncIterator[tuple[httpx.AsyncClient, httpx.Response]]:
    """A client that fetched the sign-in form and posted `key` with its token."""
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        form = await client.get("/console/login")
        assert form.status_code == 200
        match = re.search(r'name="csrf_token" value="([^"]+)"', form.text)
        assert match is not None
        body = httpx.QueryParams({"csrf_token": match.group(1), "key": key})
        answer = await client.post("/console/login", content=str(body).encode(), headers=FORM)
        yield client, answer


async def test_a_session_cookie_is_opaque_and_signing_out_ends_it_everywhere(
    base_url: str,
) -> None:
    async with _signed_in(base_url, ADMIN_KEY) as (client, answer):
        assert answer.status_code == 303
        cookie = answer.headers["set-cookie"]
        assert "lq_console=" in cookie
        assert ADMIN_KEY not in cookie
        assert "HttpOnly" in cookie
        assert "SameSite=strict" in cookie or "SameSite=Strict" in cookie
        token = client.cookies["lq_console"]
        overview = await client.get("/console")
        assert overview.status_code == 200
        csrf = re.search(r'name="csrf_token" value="([^"]+)"', overview.text)
        assert csrf is not None
        body = f"csrf_token={csrf.group(1)}".encode()
        out = await client.post("/console/logout", content=body, headers=FORM)
        assert out.status_code == 303
    # The same token, replayed by anyone, opens nothing any more.
    async with httpx.AsyncClient(base_url=base_url, cookies={"lq_console": token}) as replay:
        again = await replay.get("/console")
        assert again.status_code == 303
        assert again.headers["location"] == "/console/login"


async def test_revoking_the_admin_key_that_signed_in_ends_its_session(
    base_url: str, api: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    created = await api.post("/v1/admin/keys", json={"label": "ops"}, headers=admin)
    assert created.status_code == 201, created.text
    async with _signed_in(base_url, created.json()["key"]) as (client, answer):
        assert answer.status_code == 303
        assert (await client.get("/console")).status_code == 200
        revoked = await api.delete(f"/v1/admin/keys/{created.json()['id']}", headers=admin)
        assert revoked.status_code == 204
        after = await client.get("/console")
        assert after.status_code == 303
        assert after.headers["location"] == "/console/login"


async def test_a_page_without_a_session_sends_to_the_sign_in_and_shows_nothing(
    base_url: str,
) -> None:
    async with httpx.AsyncClient(base_url=base_url) as anonymous:
        for path in ("/console", "/console/tenants/acme", "/console/alerts"):
            answer = await anonymous.get(path)
            assert answer.status_code == 303, path
            assert answer.headers["location"] == "/console/login"
    async with httpx.AsyncClient(base_url=base_url, cookies={"lq_console": "x" * 43}) as forged:
        assert (await forged.get("/console")).status_code == 303
