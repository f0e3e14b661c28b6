"""Nothing one request carries can fail another: a request whose data the
database refuses is cut out of its batch, and the rest of the batch gets the
answers it would have got without it.

The poisoned requests here skip our own validation on purpose (they are
built as AdmitRequest records, as a bug in a check would let them through),
so PostgreSQL itself refuses them: a NUL byte is not valid UTF-8 text
(SQLSTATE 22021).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import pytest
import uvicorn

from llmquota.admission.limiter import Limiter
from llmquota.api.app import create_app
from llmquota.domain.errors import RefusedValue
from llmquota.domain.records import AdmitRequest
from tests.faults.conftest import fault_settings, put

VICTIMS = 60
ADMIN_KEY = "lq_poison_admin_key_0123456789"


def _request(tenant: str, model: str = "gpt-4o") -> AdmitRequest:
    return AdmitRequest(
        tenant=tenant,
        route=None,
        model=model,
        input_tokens=1,
        max_tokens=1,
        input_estimated=False,
        lease_seconds=None,
        idempotency_key=None,
        request_hash=None,
    )


@pytest.fixture
async def batching_limiter(database_dsn: str) -> AsyncIterator[Limiter]:
    # One batch statement at a time, so concurrent callers share batches.
    limiter = await Limiter.connect(
        database_dsn, fault_settings(batch_max_running=1, batch_window_ms=5)
    )
    yield limiter
    await limiter.close()


async def test_a_refused_value_fails_only_its_own_request(batching_limiter: Limiter) -> None:
    limiter = batching_limiter
    for tenant in ("victim", "poison"):
        await put(limiter, "tenant", tenant, max_in_flight=1_000)
    # Two poisoned requests among the victims, so bisection has to find both.
    requests = [_request("victim") for _ in range(VICTIMS)]
    requests.insert(7, _request("poison", "gpt-4o\x00"))
    requests.insert(41, _request("poison", "gpt-\x00mini"))

    statements: list[list[str]] = []
    admit = limiter.store.admit

    async def recording_admit(batch: Sequence[AdmitRequest], **kwargs: Any) -> Any:
        statements.append([r.tenant for r in batch])
        return await admit(batch, **kwargs)

    limiter.store.admit = recording_admit  # type: ignore[method-assign]
    results = await asyncio.gather(
        *(limiter.decide(request) for request in requests), return_exceptions=True
    )

    poisoned = [r for r in results if isinstance(r, BaseException)]
    admitted = [r for r in results if not isinstance(r, BaseException)]
    assert len(poisoned) == 2 and all(isinstance(p, RefusedValue) for p in poisoned)
    assert "22021" in str(poisoned[0])  # the SQLSTATE, not the server's own text
    assert len(admitted) == VICTIMS
    assert all(a.decision.status == "admitted" for a in admitted)
    # The poison really shared statements with victims, and the whole run
    # took far fewer statements than requests, bisection included.
    assert any("poison" in s and "victim" in s for s in statements)
    assert len(statements) < len(requests) / 2
    layers = {layer.scope: layer for layer in await limiter.store.layer_status("victim")}
    assert layers["tenant"].in_flight == VICTIMS


async def test_a_lone_refused_value_is_an_invalid_request(batching_limiter: Limiter) -> None:
    await put(batching_limiter, "tenant", "poison", max_in_flight=10)
    with pytest.raises(RefusedValue):
        await batching_limiter.decide(_request("poison", "\x00"))
    # Nothing was reserved for it.
    (tenant,) = [
        layer
        for layer in await batching_limiter.store.layer_status("poison")
        if layer.scope == "tenant"
    ]
    assert tenant.in_flight == 0


POISON = ("gpt-4o\u0000", "gpt-\ud800", "\u0000")


@pytest.fixture
async def served(database_dsn: str) -> AsyncIterator[str]:
    """A real uvicorn server on a free loopback port, batching; yields its URL."""
    app = create_app(fault_settings(admin_key=ADMIN_KEY), dsn=database_dsn)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        assert not task.done(), "uvicorn did not start"
        await asyncio.sleep(0.02)
    yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    server.should_exit = True
    await task


async def test_poisoned_requests_over_http_get_422_and_no_victim_gets_a_5xx(
    served: str,
) -> None:
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with httpx.AsyncClient(base_url=served, timeout=30) as client:
        keys = {}
        for tenant in ("victim", "poison"):
            policy = {"tokens_per_minute": 1_000_000, "max_in_flight": 10_000}
            await client.put(f"/v1/tenants/{tenant}/policy", json=policy, headers=admin)
            key = (await client.post(f"/v1/tenants/{tenant}/keys", headers=admin)).json()["key"]
            keys[tenant] = {"Authorization": f"Bearer {key}", "content-type": "application/json"}

        async def victim() -> int:
            body = {"tenant": "victim", "model": "gpt-4o", "input_tokens": 1, "max_tokens": 1}
            return (await client.post("/v1/admit", json=body, headers=keys["victim"])).status_code

        async def poisoned(model: str) -> httpx.Response:
            # Raw JSON, so the escapes reach the server as the client wrote them.
            body = json.dumps(
                {"tenant": "poison", "model": model, "input_tokens": 1, "max_tokens": 1}
            )
            return await client.post("/v1/admit", content=body, headers=keys["poison"])

        # Every tenth request is poisoned, all of them in flight at once.
        total = VICTIMS * 3
        jobs = [
            poisoned(POISON[i % len(POISON)]) if i % 10 == 0 else victim() for i in range(total)
        ]
        results = await asyncio.gather(*jobs)

    victims = [r for r in results if isinstance(r, int)]
    refused = [r for r in results if isinstance(r, httpx.Response)]
    assert victims.count(201) == len(victims), sorted(set(victims))
    assert len(refused) == total // 10
    for response in refused:
        assert response.status_code == 422
        assert "model" in response.text  # the error names the field
