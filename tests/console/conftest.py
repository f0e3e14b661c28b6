"""Fixtures of the console tests: a real server process and a real Chromium.

The server is `uvicorn --factory create_app_from_env` over a socket, as in
production, connected as the service's role (a grant roles.sql lacks shows
as a 500); the browser is Debian's chromium driven by Playwright (never a
downloaded one). Screenshots go to docs/console/, where they are committed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from playwright.async_api import Browser, Page, async_playwright

from tests.faults.conftest import REPO, served_process

ADMIN_KEY = "lq_console_admin_key_0123456789"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCREENSHOTS = REPO / "docs" / "console"


@pytest.fixture
async def base_url(app_dsn: str, tmp_path: Path) -> AsyncIterator[str]:
    """The URL of a server process on a fresh database; workers flush counts every 0.2 s."""
    async with served_process(
        app_dsn,
        ADMIN_KEY,
        tmp_path / "server.log",
        decision_counts_flush_seconds="0.2",
        # The alerts test's receiver listens on loopback.
        webhook_allowed_networks="127.0.0.0/8",
        alert_delivery_interval_seconds="0.1",
    ) as (base, _pid):
        yield base


@pytest.fixture
async def api(base_url: str) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client of the same server, for set-up and for the API's figures."""
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        yield client


@pytest.fixture
def admin() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    async with async_playwright() as playwright:
        chromium = await playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            await chromium.close()


@pytest.fixture
async def page(browser: Browser) -> AsyncIterator[Page]:
    context = await browser.new_context(viewport={"width": 1280, "height": 900})
    try:
        yield await context.new_page()
    finally:
        await context.close()


async def screenshot(page: Page, name: str) -> Path:
    """A full-page screenshot to docs/console/<name>.png; its path."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    await page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 1_000
    return path


async def sign_in(page: Page, base_url: str, key: str) -> int:
    """Fill the sign-in form with `key` and submit it; the POST's status."""
    await page.goto(f"{base_url}/console")
    assert page.url.endswith("/console/login")
    return await submit_key(page, key)


async def submit_key(page: Page, key: str) -> int:
    """Fill the sign-in form the page shows with `key` and submit it; the POST's status."""
    await page.fill("[data-testid=admin-key]", key)
    async with page.expect_response(
        lambda r: r.url.endswith("/console/login") and r.request.method == "POST"
    ) as answer:
        await page.click("[data-testid=sign-in-button]")
    await page.wait_for_load_state()
    return (await answer.value).status


async def put(client: httpx.AsyncClient, path: str, body: object, headers: dict[str, str]) -> None:
    response = await client.put(path, json=body, headers=headers)
    assert response.status_code in (200, 201), response.text


async def new_key(
    client: httpx.AsyncClient, tenant: str, admin: dict[str, str], **body: object
) -> tuple[int, str]:
    """A key for `tenant`: (its id, the bearer headers' token)."""
    response = await client.post(f"/v1/tenants/{tenant}/keys", json=body or None, headers=admin)
    assert response.status_code == 201, response.text
    return int(response.json()["id"]), str(response.json()["key"])


async def cells(page: Page, test_id: str) -> list[list[str]]:
    """The text of each body row of a table, cell by cell."""
    rows = page.locator(f"[data-testid={test_id}] tbody tr")
    return [
        [text.strip() for text in await rows.nth(i).locator("td").all_inner_texts()]
        for i in range(await rows.count())
    ]
