"""Fixtures for the REST API: the real app on a fresh database, over ASGI."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI

from llmquota.api.app import create_app
from llmquota.config import Settings

ADMIN_KEY = "lq_test_admin_key_0123456789"


def api_settings(**extra: object) -> Settings:
    """The settings of the API tests' app, with `extra` on top."""
    return Settings(  # type: ignore[call-arg]
        admin_key=ADMIN_KEY,
        pool_min_size=1,
        pool_max_size=10,
        # The API's outage answers are tested in tests/faults; here a slow
        # moment on a shared machine must not turn into a 503.
        decision_deadline_ms=60_000,
        # The ceiling alert detector's outbox rows would land at moments of
        # its own; tests/api/test_ceiling_alerts.py runs it where it is tested.
        ceiling_alerts=False,
        _env_file=None,
        **extra,
    )


@pytest.fixture
async def client(app_dsn: str) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client for an app whose lifespan (pool, authenticator) is
    running, connected as llmquota_app (a missing grant answers 500)."""
    app = create_app(api_settings(), dsn=app_dsn)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://llmquota") as c:
            yield c


@pytest.fixture
async def served(app_dsn: str) -> AsyncIterator[tuple[httpx.AsyncClient, FastAPI]]:
    """A client, and the app (to refresh its worker caches now rather than in a few seconds)."""
    settings = Settings(  # type: ignore[call-arg]
        admin_key=ADMIN_KEY, pool_max_size=10, decision_deadline_ms=60_000, _env_file=None
    )
    app = create_app(settings, dsn=app_dsn)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://llmquota") as c:
            yield c, app


@pytest.fixture
def admin() -> dict[str, str]:
    """Headers of the admin."""
    return {"Authorization": f"Bearer {ADMIN_KEY}"}


async def make_tenant(
    client: httpx.AsyncClient, admin: dict[str, str], tenant: str, **policy: int
) -> dict[str, str]:
    """Give `tenant` a policy and a key; returns the tenant's auth headers.

    No limits given: the tenant is stored as unlimited (a PUT must say so)."""
    body: dict[str, object] = dict(policy) if policy else {"unlimited": True}
    response = await client.put(f"/v1/tenants/{tenant}/policy", json=body, headers=admin)
    assert response.status_code == 200, response.text
    response = await client.post(f"/v1/tenants/{tenant}/keys", headers=admin)
    assert response.status_code == 201, response.text
    return {"Authorization": f"Bearer {response.json()['key']}"}


async def settle_samples(client: httpx.AsyncClient, key: dict[str, str], samples: int) -> None:
    """`samples` completions for acme of 20 input and 250 output tokens (max_tokens
    1,000), each admitted and settled ok: what learned estimates learn from."""
    for _ in range(samples):
        held = await client.post(
            "/v1/admit",
            json={"tenant": "acme", "model": "gpt-4o", "input_tokens": 20, "max_tokens": 1000},
            headers=key,
        )
        assert held.status_code == 201, held.text
        settled = await client.post(
            f"/v1/reservations/{held.json()['reservation_id']}/settle",
            json={"input_tokens": 20, "output_tokens": 250},
            headers=key,
        )
        assert settled.status_code == 200, settled.text
