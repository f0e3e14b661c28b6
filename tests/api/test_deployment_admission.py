"""Deployments over the REST API: a ceiling's `upstream`, and /v1/admit's `upstreams`.

A ceiling scoped to a deployment is stored, shown and patched with it; a
server whose proxy has upstreams refuses a name it does not know (422,
nothing written). /v1/admit takes the deployments a client may call
(`upstreams`, `upstream_rule`), the 201 names the one chosen, and the REST
client (llmquota.client) passes them through. Token rates are one per
minute: refill during a test is far below one request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from llmquota.api.app import create_app
from llmquota.client import AsyncClient
from tests.api.conftest import api_settings, make_tenant

SCOPED = {"models": ["gpt-4o"], "tokens_per_minute": 1, "token_burst": 300}


@pytest.fixture
async def with_upstreams(
    app_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[httpx.AsyncClient]:
    """A client of an app whose proxy has two deployments of gpt-4o, main and azure."""
    monkeypatch.setenv("LQ_TEST_PROVIDER_KEY", "sk-test-provider-key")
    path = tmp_path / "upstreams.toml"
    path.write_text(
        "".join(
            f'[[upstream]]\nname = "{name}"\nformat = "openai"\n'
            f'base_url = "http://127.0.0.1:9/v1"\napi_key_env = "LQ_TEST_PROVIDER_KEY"\n'
            'models = ["gpt-4o"]\n\n'
            for name in ("main", "azure")
        )
    )
    settings = api_settings(upstreams_file=str(path), openai_base_url=None, openai_api_key=None)
    app = create_app(settings, dsn=app_dsn)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://llmquota") as c:
            yield c


async def put_ceiling(
    client: httpx.AsyncClient, admin: dict[str, str], name: str, **body: Any
) -> httpx.Response:
    return await client.put(f"/v1/ceilings/{name}", json={**SCOPED, **body}, headers=admin)


async def test_a_ceiling_is_scoped_to_a_deployment_shown_and_patched(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    put = await put_ceiling(client, admin, "azure-gpt4o", upstream="azure")
    assert put.status_code == 200, put.text
    assert put.json()["upstream"] == "azure"
    listed = (await client.get("/v1/ceilings", headers=admin)).json()["ceilings"]
    assert [(c["ceiling"], c["upstream"]) for c in listed] == [("azure-gpt4o", "azure")]
    patched = await client.patch(
        "/v1/ceilings/azure-gpt4o",
        json={"upstream": None},
        headers={**admin, "content-type": "application/merge-patch+json"},
    )
    assert patched.status_code == 200, patched.text
    assert patched.json()["upstream"] is None
    bad = await put_ceiling(client, admin, "bad", upstream="a\nb")
    assert bad.status_code == 422 and "upstream" in bad.text


async def test_a_server_with_upstreams_refuses_a_deployment_it_does_not_know(
    with_upstreams: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    refused = await put_ceiling(with_upstreams, admin, "typo", upstream="azrue")
    assert refused.status_code == 422
    assert "no upstream named 'azrue'" in refused.json()["error"]["message"]
    assert "azure, main" in refused.json()["error"]["message"]
    assert (await with_upstreams.get("/v1/ceilings", headers=admin)).json()["ceilings"] == []
    accepted = await put_ceiling(with_upstreams, admin, "azure-gpt4o", upstream="azure")
    assert accepted.status_code == 200, accepted.text


async def test_admit_chooses_among_the_upstreams_named_and_says_which(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    for name in ("main", "azure"):
        assert (await put_ceiling(client, admin, f"{name}-gpt4o", upstream=name)).is_success
    key = await make_tenant(client, admin, "acme")
    body = {"tenant": "acme", "model": "gpt-4o", "input_tokens": 20, "max_tokens": 80}
    chosen = []
    for _ in range(7):
        answer = await client.post(
            "/v1/admit", json={**body, "upstreams": ["main", "azure"]}, headers=key
        )
        chosen.append(
            answer.json().get("upstream") if answer.status_code == 201 else answer.status_code
        )
    # 3 fit each ceiling: main first, then azure, then a 429.
    assert chosen == ["main", "main", "main", "azure", "azure", "azure", 429]
    plain = await client.post("/v1/admit", json=body, headers=key)
    assert plain.status_code == 429  # named none: every ceiling of the model applies
    bad = await client.post(
        "/v1/admit", json={**body, "upstreams": ["main"], "upstream_rule": "fastest"}, headers=key
    )
    assert bad.status_code == 422 and "upstream_rule" in bad.text


async def test_the_rest_client_passes_upstreams_and_reads_the_choice(
    served: tuple[httpx.AsyncClient, FastAPI], admin: dict[str, str]
) -> None:
    client, app = served
    # Both have room; azure more of it: `order` takes main, least_utilized azure.
    for name, burst in (("main", 1_000), ("azure", 2_000)):
        scoped = await put_ceiling(client, admin, f"{name}-gpt4o", upstream=name, token_burst=burst)
        assert scoped.is_success
    key = (await make_tenant(client, admin, "acme"))["Authorization"].removeprefix("Bearer ")
    transport = httpx.ASGITransport(app=app)
    async with AsyncClient("http://llmquota", key, transport=transport) as limiter:
        first = await limiter.admit(
            tenant="acme",
            model="gpt-4o",
            input_tokens=20,
            max_tokens=80,
            upstreams=["main", "azure"],
        )
        second = await limiter.admit(
            tenant="acme",
            model="gpt-4o",
            input_tokens=20,
            max_tokens=80,
            upstreams=["main", "azure"],
            upstream_rule="least_utilized",
        )
    assert (first.upstream, second.upstream) == ("main", "azure")
    assert second.admitted.answer["upstream"] == "azure"
