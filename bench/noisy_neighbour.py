"""Noisy neighbour: does one tenant flooding the API raise another's admission p99?

Starts the real service (uvicorn, `create_app_from_env`, on the embedded
PostgreSQL unless LLMQUOTA_DATABASE_URL is set), gives two tenants their own
policies and keys, then measures the quiet tenant's POST /v1/admit latency
(each admit followed by its settle, at a steady rate) twice: alone, and while
the noisy tenant floods the API from another process with many concurrent
connections (most of its requests refused with 429, as a flood would be).

    python bench/noisy_neighbour.py [--seconds 20] [--rate 50] [--flood 32] [--workers 1]
                                    [--max-in-progress 4] [--big-prompts] [--count-inline]
                                    [--runs 3] [--refusal-memory-ms 100]

--big-prompts floods with 1 MB prompts to be counted instead of small
admissions; --count-inline makes the server count every prompt on its event
loop with no CPU budget, as it did before token counting moved to a thread
pool (the "before" of that change).

Runs `--runs` (3) pairs of phases on one server and prints a line per phase,
each run's ratio of the quiet tenant's p99 under the flood to its p99 alone,
and their median; the promise is a median of at most 1.50. A benchmark,
not a test: the figures depend on the machine (RELIABILITY.md records them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from llmquota.store import migrate
from llmquota.store.database import open_database

ADMIN_KEY = "lq_bench_admin_key_0123456789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def setup(base: str) -> dict[str, str]:
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    keys: dict[str, str] = {}
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        policies = {
            # The quiet tenant has all the room it needs.
            "quiet": {"tokens_per_minute": 10_000_000, "requests_per_minute": 1_000_000},
            # The noisy one has a small budget: its flood is mostly refused.
            "noisy": {
                "tokens_per_minute": 60_000,
                "token_burst": 10_000,
                "requests_per_minute": 6_000,
            },
        }
        for tenant, policy in policies.items():
            r = await client.put(f"/v1/tenants/{tenant}/policy", json=policy, headers=admin)
            r.raise_for_status()
            r = await client.post(f"/v1/tenants/{tenant}/keys", headers=admin)
            keys[tenant] = r.json()["key"]
    return keys


async def quiet_tenant(base: str, key: str, seconds: float, rate: float) -> list[float]:
    """Admit-then-settle at a steady rate; the admit latencies in milliseconds."""
    headers = {"Authorization": f"Bearer {key}"}
    body = {"tenant": "quiet", "model": "gpt-4o", "input_tokens": 200, "max_tokens": 500}
    latencies: list[float] = []
    interval = 1.0 / rate
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        await client.post("/v1/admit", json=body, headers=headers)  # warm the connection
        start = time.perf_counter()
        next_at = start
        while time.perf_counter() - start < seconds:
            next_at += interval
            t0 = time.perf_counter()
            r = await client.post("/v1/admit", json=body, headers=headers)
            latencies.append((time.perf_counter() - t0) * 1000)
            if r.status_code == 201:
                await client.post(
                    f"/v1/reservations/{r.json()['reservation_id']}/settle",
                    json={"input_tokens": 200, "output_tokens": 100},
                    headers=headers,
                )
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
    return latencies


# A megabyte of prompt: what a flood of big prompts sends each time.
BIG_PROMPT = [{"role": "user", "content": "word " * 200_000}]


def flood(
    base: str, key: str, seconds: float, connections: int, out: Any, *, big_prompts: bool
) -> None:
    """Run in another process: `connections` clients admitting as fast as they can."""

    async def one(client: httpx.AsyncClient, stop_at: float, tally: dict[int, int]) -> None:
        body: dict[str, Any] = {"tenant": "noisy", "model": "gpt-4o", "max_tokens": 300}
        if big_prompts:
            body["messages"] = BIG_PROMPT
        else:
            body["input_tokens"] = 200
        headers = {"Authorization": f"Bearer {key}"}
        while time.perf_counter() < stop_at:
            r = await client.post("/v1/admit", json=body, headers=headers)
            tally[r.status_code] = tally.get(r.status_code, 0) + 1
            if r.status_code == 201:
                await client.post(
                    f"/v1/reservations/{r.json()['reservation_id']}/settle",
                    json={"input_tokens": 200, "output_tokens": 50},
                    headers=headers,
                )

    async def main() -> dict[int, int]:
        tally: dict[int, int] = {}
        limits = httpx.Limits(max_connections=connections)
        async with httpx.AsyncClient(base_url=base, timeout=30, limits=limits) as client:
            stop_at = time.perf_counter() + seconds
            await asyncio.gather(*(one(client, stop_at, tally) for _ in range(connections)))
        return tally

    out.put(asyncio.run(main()))


def run(args: argparse.Namespace) -> dict[str, Any]:
    data_dir = Path(tempfile.mkdtemp(prefix="llmquota-bench-")) / "pg"
    with open_database(os.environ.get("LLMQUOTA_DATABASE_URL"), data_dir) as db:
        migrate.upgrade(db.dsn)
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        env = {
            **os.environ,
            "LLMQUOTA_DATABASE_URL": db.dsn,
            "LLMQUOTA_ADMIN_KEY": ADMIN_KEY,
            "LLMQUOTA_TENANT_MAX_IN_PROGRESS": str(args.max_in_progress),
            "LLMQUOTA_MAX_BODY_BYTES": str(2 * 1_048_576),
            "LLMQUOTA_REFUSAL_MEMORY_MS": str(args.refusal_memory_ms),
        }
        if args.count_inline:
            env["LLMQUOTA_TOKEN_COUNT_INLINE_CHARS"] = "10000000"
            env["LLMQUOTA_TOKEN_COUNT_CPU_BUDGET_MS"] = "60000"
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "uvicorn",
                "llmquota.api.app:create_app_from_env",
                "--factory",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--workers",
                str(args.workers),
                "--log-level",
                "warning",
            ],
            env=env,
        )
        try:
            for _ in range(200):
                try:
                    if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
            keys = asyncio.run(setup(base))
            rounds = [flood_round(args, base, keys) for _ in range(args.runs)]
        finally:
            server.terminate()
            server.wait(timeout=30)
    ratios = [r["p99_ratio"] for r in rounds]
    return {"rounds": rounds, "median_p99_ratio": statistics.median(ratios)}


def flood_round(args: argparse.Namespace, base: str, keys: dict[str, str]) -> dict[str, Any]:
    """One run: the quiet tenant alone, then while the noisy tenant floods."""
    alone = asyncio.run(quiet_tenant(base, keys["quiet"], args.seconds, args.rate))
    results: multiprocessing.Queue[dict[int, int]] = multiprocessing.Queue()
    flooder = multiprocessing.Process(
        target=flood,
        args=(base, keys["noisy"], args.seconds + 2, args.flood, results),
        kwargs={"big_prompts": args.big_prompts},
    )
    flooder.start()
    time.sleep(1.0)  # let the flood reach full speed
    crowded = asyncio.run(quiet_tenant(base, keys["quiet"], args.seconds, args.rate))
    flooder.join(timeout=args.seconds + 120)
    tally = results.get(timeout=5) if not results.empty() else {}
    if flooder.is_alive():
        flooder.terminate()
    report: dict[str, Any] = {
        "alone": {
            "n": len(alone),
            "p50_ms": statistics.median(alone),
            "p99_ms": percentile(alone, 0.99),
        },
        "flooded": {
            "n": len(crowded),
            "p50_ms": statistics.median(crowded),
            "p99_ms": percentile(crowded, 0.99),
        },
        "noisy_requests": {str(k): v for k, v in sorted(tally.items())},
        "noisy_requests_per_second": sum(tally.values()) / (args.seconds + 2),
    }
    report["p99_ratio"] = report["flooded"]["p99_ms"] / report["alone"]["p99_ms"]
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each phase")
    parser.add_argument("--rate", type=float, default=50.0, help="quiet admits per second")
    parser.add_argument("--flood", type=int, default=32, help="noisy concurrent connections")
    parser.add_argument("--workers", type=int, default=1, help="uvicorn worker processes")
    parser.add_argument(
        "--max-in-progress",
        type=int,
        default=4,
        help="LLMQUOTA_TENANT_MAX_IN_PROGRESS for the server (10000: fair share off)",
    )
    parser.add_argument(
        "--big-prompts", action="store_true", help="flood with 1 MB prompts to be counted"
    )
    parser.add_argument(
        "--count-inline",
        action="store_true",
        help="the server counts every prompt on its event loop, no CPU budget (the old way)",
    )
    parser.add_argument(
        "--runs", type=int, default=3, help="alone/flooded pairs; the median counts"
    )
    parser.add_argument(
        "--refusal-memory-ms",
        type=int,
        default=100,
        help="LLMQUOTA_REFUSAL_MEMORY_MS for the server (0: every refusal is a statement)",
    )
    args = parser.parse_args()
    report = run(args)
    for number, round_ in enumerate(report["rounds"], 1):
        for phase in ("alone", "flooded"):
            p = round_[phase]
            print(
                f"run {number}: quiet tenant {phase:>7}: n={p['n']} p50={p['p50_ms']:.2f} ms "
                f"p99={p['p99_ms']:.2f} ms"
            )
        print(
            f"run {number}: noisy tenant {round_['noisy_requests_per_second']:.0f} requests/s, "
            f"statuses {round_['noisy_requests']}; quiet p99 flooded/alone "
            f"{round_['p99_ratio']:.2f}"
        )
    print(
        f"quiet p99 flooded/alone, median of {args.runs}: {report['median_p99_ratio']:.2f} "
        f"(promise: <= 1.50; max_in_progress={args.max_in_progress}, workers={args.workers}, "
        f"flood={args.flood}, big_prompts={args.big_prompts}, count_inline={args.count_inline}, "
        f"refusal_memory_ms={args.refusal_memory_ms})"
    )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
