"""Abandoned streams to a hanging upstream cannot starve another tenant's proxy traffic.

The upstream is the proxy tests' fake provider in a process of its own,
hanging mid-stream for one model; llmquota is a uvicorn server process in
proxy mode. One tenant (no max_in_flight) opens 200 streams to the hanging
model and hangs up after the first bytes, in the default `drain` mode. Its
streams get at most its share of the upstream's pool, its drains are capped
(further hang-ups cancel), and another tenant's plain requests, through the
official openai SDK, are answered in under 2 s throughout.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import openai
import pytest

from llmquota.admission.limiter import Limiter
from tests.faults.conftest import metric_value, port_of_process, served_process

ADMIN_KEY = "lq_upstream_isolation_admin_01"
ABANDONED = 200
QUIET_REQUESTS = 10
ANSWER_BOUND_SECONDS = 2.0


@contextlib.asynccontextmanager
async def hanging_upstream(model: str) -> AsyncIterator[str]:
    """The fake provider as a process, hanging mid-stream for `model`; its URL."""
    async with port_of_process("tests.proxy.fake_provider", model) as port:
        yield f"http://127.0.0.1:{port}"


@pytest.mark.slow
async def test_200_abandoned_streams_to_a_hanging_upstream_leave_another_tenant_served(
    limiter: Limiter, database_dsn: str, tmp_path: Path
) -> None:
    async with (
        hanging_upstream("gpt-4o-hang") as upstream,
        served_process(
            database_dsn,
            ADMIN_KEY,
            tmp_path / "server.log",
            LLMQUOTA_OPENAI_BASE_URL=f"{upstream}/v1",
            LLMQUOTA_OPENAI_API_KEY="sk-upstream-isolation-0123",
            LLMQUOTA_PROXY_MAX_CONNECTIONS="200",
            LLMQUOTA_TENANT_MAX_IN_PROGRESS="1000",
            LLMQUOTA_TENANT_MAX_QUEUED="1000",
            # Long enough to outlast the quiet tenant's requests; short enough
            # that the server's shutdown, which lets drains run to their bound,
            # is quick.
            LLMQUOTA_PROXY_DRAIN_SECONDS="15",
        ) as (base, _pid),
    ):
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        async with httpx.AsyncClient(base_url=base, headers=admin, timeout=30) as client:
            keys = {}
            for tenant in ("noisy", "quiet"):
                policy = {"tokens_per_minute": 10_000_000, "token_burst": 5_000_000}
                assert (await client.put(f"/v1/tenants/{tenant}/policy", json=policy)).is_success
                keys[tenant] = (await client.post(f"/v1/tenants/{tenant}/keys")).json()["key"]

        # The noisy tenant's key is known to the worker before its flood (a
        # flood of never-seen keys meets the unknown-key lane instead).
        warm = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=keys["noisy"], max_retries=0)
        await warm.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}], max_tokens=5
        )
        await warm.close()
        statuses: Counter[int] = Counter()
        refusals: list[str] = []
        limits = httpx.Limits(max_connections=ABANDONED + 10)
        async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as noisy:

            async def abandon() -> None:
                body = {
                    "model": "gpt-4o-hang",
                    "stream": True,
                    "max_tokens": 50,
                    "messages": [{"role": "user", "content": "hang"}],
                }
                headers = {"Authorization": f"Bearer {keys['noisy']}"}
                async with noisy.stream(
                    "POST", "/v1/chat/completions", json=body, headers=headers
                ) as response:
                    statuses[response.status_code] += 1
                    if response.status_code == 429:
                        refusals.append((await response.aread()).decode())
                    if response.status_code == 200:
                        # The first bytes. The iterator is kept: a dropped one is
                        # closed at once, which hangs up before the flood is over.
                        chunks = response.aiter_bytes()
                        assert await anext(chunks)
                    # Every stream holds on until all were answered, so the
                    # flood is one burst however slowly its requests arrive;
                    # leaving the block then hangs up.
                    if sum(statuses.values()) == ABANDONED:
                        all_answered.set()
                    await all_answered.wait()

            all_answered = asyncio.Event()
            await asyncio.gather(*(abandon() for _ in range(ABANDONED)))

        quiet = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=keys["quiet"], max_retries=0)
        latencies = []
        try:
            for _ in range(QUIET_REQUESTS):
                started = time.perf_counter()
                answer = await quiet.chat.completions.create(
                    model="gpt-4o-mini",
                    messages=[{"role": "user", "content": "hello"}],
                    max_tokens=20,
                    timeout=30,
                )
                latencies.append(time.perf_counter() - started)
                assert answer.choices[0].message.content
        finally:
            await quiet.close()
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            exposition = (await client.get("/metrics")).text

    drains = metric_value(exposition, "llmquota_proxy_drains_in_progress")
    print(f"noisy {dict(statuses)}; quiet max {max(latencies):.3f} s; drains {drains}")
    assert max(latencies) < ANSWER_BOUND_SECONDS, latencies
    # Its share of the pool (100 of 200) streamed; the rest were refused at once.
    assert statuses[200] == 100 and statuses[429] == ABANDONED - 100, statuses
    assert all("holds its share of the connections" in body for body in refusals)
    # The cap of its abandoned streams are drained (the upstream hangs, so
    # they still are); every other hang-up was cancelled.
    assert drains == 8
