"""Graceful shutdown with a stream in flight: SIGTERM to a real uvicorn server
process while the official openai SDK is reading a stream through it.

Whether uvicorn lets the stream run to its end (no graceful timeout) or cuts
it off after its graceful timeout, the reservation is finished exactly once
before the process exits: settled with the provider's usage when the stream
ended, else with what was counted when the drain was cut short."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator

import asyncpg
import httpx
import openai
import pytest

from tests.ports import reserved_port
from tests.proxy.conftest import ADMIN, ADMIN_KEY, GENEROUS, ledger, reservation_states
from tests.proxy.fake_provider import PROMPT_TOKENS, PROVIDER_KEY, FakeProvider, completion_tokens

MESSAGES = [{"role": "user", "content": "Say something long."}]


def _free_port() -> int:
    return reserved_port()


@contextlib.asynccontextmanager
async def server_process(
    dsn: str, fake_url: str, *uvicorn_args: str, **settings: str
) -> AsyncIterator[tuple[asyncio.subprocess.Process, str]]:
    """llmquota under uvicorn in a process of its own, proxying to the fake."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMQUOTA_")}
    env |= {
        "LLMQUOTA_DATABASE_URL": dsn,
        "LLMQUOTA_ADMIN_KEY": ADMIN_KEY,
        "LLMQUOTA_OPENAI_BASE_URL": f"{fake_url}/v1",
        "LLMQUOTA_OPENAI_API_KEY": PROVIDER_KEY,
        "LLMQUOTA_POOL_MIN_SIZE": "1",
        "LLMQUOTA_DECISION_DEADLINE_MS": "30000",
    }
    env |= {f"LLMQUOTA_{name.upper()}": value for name, value in settings.items()}
    port = _free_port()
    process = await asyncio.create_subprocess_exec(
        *[sys.executable, "-m", "uvicorn", "--factory", "llmquota.api.app:create_app_from_env"],
        *["--host", "127.0.0.1", "--port", str(port), "--log-level", "info", *uvicorn_args],
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=base) as client:
            for _ in range(300):
                assert process.returncode is None, await _output(process)
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get("/healthz")).status_code == 200:
                        break
                await asyncio.sleep(0.1)
        yield process, base
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def _output(process: asyncio.subprocess.Process) -> str:
    assert process.stdout is not None
    return (await process.stdout.read()).decode(errors="replace")


@pytest.mark.parametrize(
    ("uvicorn_args", "words", "outcome"),
    [
        ((), 20, "ok"),  # uvicorn waits for the response: the stream ends as the provider's
        (("--timeout-graceful-shutdown", "1"), 80, "cancelled"),  # cut off, drain bounded
    ],
)
async def test_sigterm_with_a_stream_in_flight_finishes_its_reservation_once(
    fake: tuple[FakeProvider, str],
    *,
    database_dsn: str,
    db: asyncpg.Connection,
    uvicorn_args: tuple[str, ...],
    words: int,
    outcome: str,
) -> None:
    provider, fake_url = fake
    provider.words, provider.delay = words, 0.05
    settings = {"proxy_drain_seconds": "1", "proxy_heartbeat_seconds": "0.2"}
    async with server_process(database_dsn, fake_url, *uvicorn_args, **settings) as (process, url):
        async with httpx.AsyncClient(base_url=url, headers=ADMIN) as admin:
            assert (await admin.put("/v1/tenants/acme/policy", json=GENEROUS)).is_success
            key = (await admin.post("/v1/tenants/acme/keys")).json()["key"]
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
        stream = await client.chat.completions.create(
            model="gpt-4o", messages=MESSAGES, max_tokens=500, stream=True
        )
        text, broken = "", False
        try:
            async for chunk in stream:
                text += chunk.choices[0].delta.content or "" if chunk.choices else ""
                if text.count(" ") == 3 and process.returncode is None:
                    process.send_signal(signal.SIGTERM)
        except (openai.APIError, httpx.HTTPError):
            broken = True
        finally:
            await client.close()
        # uvicorn re-raises the SIGTERM it caught once it has shut down: -15 is a clean end.
        exit_code = await asyncio.wait_for(process.wait(), 30)
        output = await _output(process)
        assert exit_code in (0, -signal.SIGTERM), output
        assert "Application shutdown complete" in output  # the lifespan ran to its end
    rows = await ledger(db)
    assert len(rows) == 1, rows  # exactly once, before the process exited
    assert await reservation_states(db) == ["settled"]
    row = rows[0]
    assert row["outcome"] == outcome
    if outcome == "ok":
        assert not broken and text == "".join(f" w{i}" for i in range(words))
        assert (row["input_tokens"], row["output_tokens"]) == (PROMPT_TOKENS, 2 * words + 1)
    else:
        assert provider.streams_finished == 0  # cut off: nothing reported a final usage
        assert 0 < row["output_tokens"] < completion_tokens(words)
