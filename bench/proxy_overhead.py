"""Proxy overhead: what llmquota's proxy mode adds to a provider call.

Starts the fake provider of the proxy tests (tests/proxy/fake_provider.py,
OpenAI's wire format, a fixed delay per output word) in a process of its own,
llmquota in proxy mode in front of it (uvicorn, `create_app_from_env`, one
worker, on the embedded PostgreSQL unless LLMQUOTA_DATABASE_URL is set) and,
when a `litellm` executable is found, LiteLLM's proxy in front of the same
fake. Then, with the official openai SDK (AsyncOpenAI), side by side in one
run, each target in turn request by request so drift hits all alike:

- non-stream latency, one request at a time (p50, p99);
- stream time to first token, one stream at a time (the first chunk with text);
- completed streams per second at 64 concurrent streams.

    python bench/proxy_overhead.py [--quick] [--litellm PATH] [--idle-ms MS]

With --idle-ms every timed call of the first two runs comes after that long
with nothing sent, as calls at a low rate do: a process idle longer wakes
slower on this machine. (Between two timed calls of one target the other
targets' calls run too, so a stream still follows a longer spell than a
non-stream call does: the others' streams.)

The last lines are the summary, in the form
`proxy overhead: p50 +X ms, p99 +Y ms, ttft +Z ms (llmquota) vs ... (litellm)`,
then what scrubbing the provider key from every relayed byte costs (the
fake's own answer and stream through the proxy's scrubber, per answer and as
a share of llmquota's added p50), then the figures as JSON. A benchmark, not
a test: the numbers depend on the machine (BENCHMARKS.md records a run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# Run as a script, Python puts bench/ first on the path; the repository root
# lets `bench.*` and `tests.*` import as packages.
sys.path[0] = str(ROOT)

import httpx  # noqa: E402
import openai  # noqa: E402
from openai.types.chat import ChatCompletionMessageParam  # noqa: E402
from tests.proxy.fake_provider import PROVIDER_KEY, FakeProvider  # noqa: E402

from bench.noisy_neighbour import free_port, percentile  # noqa: E402
from llmquota.domain.scrubbing import SecretScrubber  # noqa: E402
from llmquota.store import migrate  # noqa: E402
from llmquota.store.database import open_database  # noqa: E402

ADMIN_KEY = "lq_bench_admin_key_0123456789"
LITELLM_KEY = "sk-bench-litellm-master"
MODEL = "gpt-4o"
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say something short."}]
WORDS = 16  # output words per answer
WORD_DELAY_S = 0.005  # the fake's pause before each streamed word: 80 ms a stream
CONCURRENT_STREAMS = 64


@dataclass(frozen=True)
class Plan:
    requests: int  # non-stream requests per target
    streams: int  # sequential streams per target (time to first token)
    load_seconds: float  # length of the 64-stream phase per target


FULL = Plan(requests=400, streams=200, load_seconds=15.0)
QUICK = Plan(requests=60, streams=40, load_seconds=4.0)


def serve_fake(port: int, semantic_embeddings: bool = False) -> None:
    """In a process of its own: the fake provider on `port` (WORDS words an
    answer, WORD_DELAY_S before each streamed one); with `semantic_embeddings`
    its /v1/embeddings are bag-of-words vectors, so paraphrases are close."""
    import uvicorn

    fake = FakeProvider(words=WORDS, delay=WORD_DELAY_S, semantic_embeddings=semantic_embeddings)
    uvicorn.run(fake.app(), host="127.0.0.1", port=port, log_level="warning")


def wait_until_up(url: str, process: subprocess.Popen[bytes] | None = None) -> None:
    for _ in range(600):
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{process.args!r} exited with {process.returncode}")
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()


@contextmanager
def fake_provider(*, semantic_embeddings: bool = False) -> Iterator[str]:
    """The fake provider in a process of its own; yields its OpenAI base URL."""
    port = free_port()
    process = multiprocessing.Process(
        target=serve_fake, args=(port, semantic_embeddings), daemon=True
    )
    process.start()
    try:
        wait_until_up(f"http://127.0.0.1:{port}/")
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        process.terminate()
        process.join(timeout=10)


@contextmanager
def llmquota(fake_url: str, *, allotted: bool = False) -> Iterator[str]:
    """llmquota in proxy mode on its own database; yields a tenant's key@base URL.
    `allotted`: the tenant's policy says "admission": "allotted" (and has no
    max_in_flight, which is always decided exactly)."""
    data_dir = Path(tempfile.mkdtemp(prefix="llmquota-bench-")) / "pg"
    policy: dict[str, Any] = {"max_in_flight": None, "admission": "allotted"} if allotted else {}
    with open_database(os.environ.get("LLMQUOTA_DATABASE_URL"), data_dir) as db:
        migrate.upgrade(db.dsn)
        with proxy_server(db.dsn, fake_url) as base:
            yield f"{tenant_key(base, **policy)}@{base}/v1"


@contextmanager
def proxy_server(dsn: str, fake_url: str) -> Iterator[str]:
    """llmquota in proxy mode (uvicorn, one worker) on the migrated database `dsn`,
    in front of the fake at `fake_url`; yields its base URL."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "LLMQUOTA_DATABASE_URL": dsn,
        "LLMQUOTA_ADMIN_KEY": ADMIN_KEY,
        "LLMQUOTA_OPENAI_BASE_URL": fake_url,
        "LLMQUOTA_OPENAI_API_KEY": PROVIDER_KEY,
        # Throughput on two shared cores, not the outage path (as bench/run.py does).
        "LLMQUOTA_DECISION_DEADLINE_MS": "60000",
    }
    command = [sys.executable, "-m", "uvicorn", "llmquota.api.app:create_app_from_env"]
    command += ["--factory", "--host", "127.0.0.1", "--port", str(port)]
    server = subprocess.Popen([*command, "--log-level", "warning"], env=env)
    try:
        wait_until_up(f"{base}/healthz", server)
        yield base
    finally:
        stop(server)


# Limits a bench tenant never reaches: the bench measures the proxy, not refusals.
UNLIMITED_POLICY: dict[str, Any] = {
    "tokens_per_minute": 1_000_000_000,
    "token_burst": 100_000_000,
    "requests_per_minute": 100_000_000,
    "max_in_flight": 10_000,
}


def tenant_key(base: str, tenant: str = "bench", **policy: Any) -> str:
    """A fresh key of `tenant`, whose policy is UNLIMITED_POLICY with `policy`'s
    members added (a `cache`, say)."""
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with httpx.Client(base_url=base, headers=admin, timeout=30) as client:
        answer = client.put(f"/v1/tenants/{tenant}/policy", json={**UNLIMITED_POLICY, **policy})
        if answer.is_error:
            # Said in full: a 422 here names the policy member this server refuses.
            raise RuntimeError(f"PUT {answer.url.path}: {answer.status_code} {answer.text}")
        response = client.post(f"/v1/tenants/{tenant}/keys")
        response.raise_for_status()
        return str(response.json()["key"])


def find_litellm(given: str | None) -> str | None:
    if given:
        return given
    beside = Path(sys.executable).parent / "litellm"
    return str(beside) if beside.exists() else shutil.which("litellm")


@contextmanager
def litellm(executable: str, fake_url: str) -> Iterator[str]:
    """LiteLLM's proxy, no database, one model routed to the fake, offline."""
    folder = Path(tempfile.mkdtemp(prefix="litellm-bench-"))
    config = folder / "config.yaml"
    config.write_text(
        "model_list:\n"
        f"  - model_name: {MODEL}\n"
        "    litellm_params:\n"
        f"      model: openai/{MODEL}\n"
        f"      api_base: {fake_url}\n"
        f"      api_key: {PROVIDER_KEY}\n"
        "general_settings:\n"
        f"  master_key: {LITELLM_KEY}\n"
    )
    port = free_port()
    # The bundled cost map, not a download: the run stays offline.
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR"}
    command = [executable, "--config", str(config), "--host", "127.0.0.1", "--port", str(port)]
    log = (folder / "litellm.log").open("wb")
    server = subprocess.Popen(
        [*command, "--num_workers", "1"], env=env, cwd=folder, stdout=log, stderr=log
    )
    try:
        wait_until_up(f"http://127.0.0.1:{port}/health/liveliness", server)
        yield f"{LITELLM_KEY}@http://127.0.0.1:{port}"
    finally:
        stop(server)
        log.close()


def client(target: str) -> openai.AsyncOpenAI:
    key, base = target.split("@", 1)
    return openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0, timeout=60)


async def completion(sdk: openai.AsyncOpenAI) -> float:
    started = time.perf_counter()
    answer = await sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=64)
    assert answer.choices[0].message.content
    return time.perf_counter() - started


async def first_token(sdk: openai.AsyncOpenAI) -> float:
    """Time to the first chunk with text; the stream is then read to its end."""
    started = time.perf_counter()
    ttft = 0.0
    stream = await sdk.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=64, stream=True
    )
    async for chunk in stream:
        if not ttft and chunk.choices and chunk.choices[0].delta.content:
            ttft = time.perf_counter() - started
    assert ttft
    return ttft


async def interleaved(
    sdks: dict[str, openai.AsyncOpenAI],
    one: Callable[[openai.AsyncOpenAI], Awaitable[float]],
    count: int,
    idle_s: float = 0.0,
) -> dict[str, list[float]]:
    """`count` sequential calls per target, the targets taking turns; milliseconds.
    `idle_s`: each timed call comes after that long with nothing sent, as at a
    low request rate (a process idle that long wakes slower on this machine)."""
    for sdk in sdks.values():  # warm connections, caches, the JIT of nobody
        for _ in range(5):
            await one(sdk)
    times: dict[str, list[float]] = {name: [] for name in sdks}
    for _ in range(count):
        for name, sdk in sdks.items():
            if idle_s:
                await asyncio.sleep(idle_s)
            times[name].append(await one(sdk) * 1000)
    return times


async def streams_per_second(sdk: openai.AsyncOpenAI, seconds: float) -> dict[str, float]:
    """Completed streams per second with CONCURRENT_STREAMS open at all times."""
    done, failed = 0, 0
    stop_at = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done, failed
        while time.perf_counter() < stop_at:
            try:
                await first_token(sdk)
                done += 1
            except (openai.APIError, AssertionError):
                failed += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(CONCURRENT_STREAMS)))
    elapsed = time.perf_counter() - started
    return {"streams_per_s": done / elapsed, "failed": failed}


async def measure(targets: dict[str, str], plan: Plan, idle_s: float = 0.0) -> dict[str, Any]:
    sdks = {name: client(target) for name, target in targets.items()}
    try:
        latency = await interleaved(sdks, completion, plan.requests, idle_s)
        ttft = await interleaved(sdks, first_token, plan.streams, idle_s)
        load = {
            name: await streams_per_second(sdk, plan.load_seconds) for name, sdk in sdks.items()
        }
    finally:
        for sdk in sdks.values():
            await sdk.close()
    report: dict[str, Any] = {}
    for name in sdks:
        report[name] = {
            "latency_p50_ms": statistics.median(latency[name]),
            "latency_p99_ms": percentile(latency[name], 0.99),
            "ttft_p50_ms": statistics.median(ttft[name]),
            "ttft_p99_ms": percentile(ttft[name], 0.99),
            **load[name],
        }
    return report


def scrub_cost(fake_url: str) -> dict[str, float]:
    """What scrubbing the provider key costs per relayed answer, in microseconds:
    the exact bytes the fake answers (one body; one stream, chunk by chunk, as
    the proxy relays it) through the proxy's SecretScrubber, timed in-process."""
    scrubber = SecretScrubber(PROVIDER_KEY)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 64}
    headers = {"Authorization": f"Bearer {PROVIDER_KEY}"}
    with httpx.Client(base_url=fake_url, headers=headers, timeout=30) as http:
        answer = http.post("/chat/completions", json=body).content
        with http.stream("POST", "/chat/completions", json={**body, "stream": True}) as stream:
            chunks = list(stream.iter_raw())
    repeats = 2_000

    def timed(pieces: list[bytes]) -> float:
        started = time.perf_counter()
        for _ in range(repeats):
            for piece in pieces:
                scrubber.scrub(piece)
        return (time.perf_counter() - started) / repeats * 1e6

    return {
        "answer_us": timed([answer]),
        "answer_bytes": len(answer),
        "stream_us": timed(chunks),
        "stream_chunks": len(chunks),
    }


def added(report: dict[str, Any], proxy: str) -> str:
    """One proxy's overhead over the direct calls, as the summary line shows it."""
    mine, direct = report[proxy], report["direct"]
    p50 = mine["latency_p50_ms"] - direct["latency_p50_ms"]
    p99 = mine["latency_p99_ms"] - direct["latency_p99_ms"]
    ttft = mine["ttft_p50_ms"] - direct["ttft_p50_ms"]
    return f"p50 {p50:+.1f} ms, p99 {p99:+.1f} ms, ttft {ttft:+.1f} ms ({proxy})"


def run(args: argparse.Namespace) -> tuple[dict[str, Any], str | None]:
    """Every target up at once, measured side by side; the report and why not LiteLLM."""
    plan = QUICK if args.quick else FULL
    executable = find_litellm(args.litellm)
    litellm_missing: str | None = None if executable else "not installed (--litellm PATH)"
    with ExitStack() as stack:
        fake_url = stack.enter_context(fake_provider())
        targets = {
            "direct": f"{PROVIDER_KEY}@{fake_url}",
            "llmquota": stack.enter_context(llmquota(fake_url)),
            "allotted": stack.enter_context(llmquota(fake_url, allotted=True)),
        }
        if executable:
            try:
                targets["litellm"] = stack.enter_context(litellm(executable, fake_url))
            except RuntimeError as exc:
                litellm_missing = f"did not start: {exc}"
        report = asyncio.run(measure(targets, plan, args.idle_ms / 1000))
        report["scrubbing"] = scrub_cost(fake_url)
        return report, litellm_missing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="a short run (under a minute without --idle-ms)"
    )
    parser.add_argument("--litellm", help="the litellm executable (default: beside python, PATH)")
    parser.add_argument(
        "--idle-ms",
        type=float,
        default=0.0,
        help="sleep this long before each timed call of the latency and ttft runs (default 0)",
    )
    args = parser.parse_args()
    report, litellm_missing = run(args)
    scrubbing = report.pop("scrubbing")
    for name, figures in report.items():
        print(
            f"{name:>8}: latency p50 {figures['latency_p50_ms']:.1f} ms "
            f"p99 {figures['latency_p99_ms']:.1f} ms, ttft p50 {figures['ttft_p50_ms']:.1f} ms "
            f"p99 {figures['ttft_p99_ms']:.1f} ms, {CONCURRENT_STREAMS} streams: "
            f"{figures['streams_per_s']:.0f}/s ({figures['failed']:.0f} failed)"
        )
    rates = ", ".join(f"{name} {f['streams_per_s']:.0f}/s" for name, f in report.items())
    print(f"streams at {CONCURRENT_STREAMS} concurrent: {rates}")
    theirs = (
        added(report, "litellm") if "litellm" in report else f"n/a (litellm: {litellm_missing})"
    )
    print(f"proxy overhead: {added(report, 'llmquota')} vs {theirs}")
    print(f"proxy overhead, an allotted tenant: {added(report, 'allotted')}")
    overhead_us = (report["llmquota"]["latency_p50_ms"] - report["direct"]["latency_p50_ms"]) * 1e3
    print(
        f"key scrubbing: {scrubbing['answer_us']:.1f} us per answer "
        f"({scrubbing['answer_bytes']:.0f} bytes), {scrubbing['stream_us']:.1f} us per stream "
        f"({scrubbing['stream_chunks']:.0f} chunks); "
        f"{100 * scrubbing['answer_us'] / max(overhead_us, 1.0):.2f}% of llmquota's added p50"
    )
    print(json.dumps({**report, "scrubbing": scrubbing}))


if __name__ == "__main__":
    main()
