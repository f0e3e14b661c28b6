"""Comparison 2: HTTP admission end to end, `llmquota serve` vs FastAPI + Redis-Lua.

Both servers run 2 uvicorn workers on loopback (then 1 each, `llmquota
serve`'s default) and take the same request (the same JSON body, messages
counted with tiktoken, the same bearer key), driven by the same load
generator, wrk, at the same number of connections (closed loop, throughput at
saturation), then at a fixed open-loop rate (bench/open_loop.py: latency at a
load both can carry, and the CPU each request cost the server and its store).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench import process_cpu
from bench.servers import free_port, wait_for_port

ROOT = Path(__file__).resolve().parent.parent
WORKERS = 2
ADMIN_KEY = "lq_bench_admin_key_0123456789abcdef"
SERVER_START_TIMEOUT_S = 60.0

# wrk script: POST /v1/admit, the tenant fixed (hot) or uniform over N tenants.
WRK_SCRIPT = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer {key}"
local tenants = {tenants}
local body1 = '{{"tenant": "t'
local body2 = '", "model": "gpt-4o", "max_tokens": 2000, "messages": [{{"role": "user", ' ..
  '"content": "Summarise this contract and list every liability clause."}}]}}'
request = function()
  local t = 0
  if tenants > 1 then t = math.random(0, tenants - 1) end
  return wrk.format(nil, "/v1/admit", nil, body1 .. t .. body2)
end
"""


# A server started: its process and the port it listens on.
Started = tuple[subprocess.Popen[bytes], int]


@dataclass(frozen=True)
class HttpResult:
    system: str
    workload: str
    connections: int
    per_second: float
    p50_ms: float
    p99_ms: float
    non_2xx: int
    # Open loop only: CPU per request sent, in us, of the server's processes
    # and of the store's (PostgreSQL's or Redis's), when their pids were given.
    server_cpu_us: float | None = None
    store_cpu_us: float | None = None


def wrk() -> str:
    """wrk's path (bench/setup.sh installs it when missing)."""
    path = shutil.which("wrk")
    if path is None:
        raise RuntimeError("wrk is not installed: run bench/setup.sh")
    return path


def _start(command: list[str], env: dict[str, str], port: int) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_for_port("127.0.0.1", port, SERVER_START_TIMEOUT_S)
        time.sleep(1.0)  # both workers up, not only the first
    except BaseException:
        stop(process)
        raise
    return process


def stop(process: subprocess.Popen[bytes]) -> None:
    # uvicorn's supervisor stops its workers on SIGINT; it leads its own session.
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def start_llmquota(dsn: str, workers: int = WORKERS) -> Started:
    port = free_port()
    env = {
        **os.environ,
        "LLMQUOTA_DATABASE_URL": dsn,
        "LLMQUOTA_ADMIN_KEY": ADMIN_KEY,
        "LLMQUOTA_LOG_LEVEL": "warning",
    }
    command = [
        str(Path(sys.executable).with_name("llmquota")),
        *("serve", "--host", "127.0.0.1", "--port", str(port), "--workers", str(workers)),
    ]
    return _start(command, env, port), port


def start_bare_asgi(workers: int = WORKERS) -> Started:
    """bench/bare_asgi.py on uvicorn as `llmquota serve` runs it (its guarded
    httptools protocol, uvloop)."""
    port = free_port()
    command = [
        sys.executable,
        *("-m", "uvicorn", "bench.bare_asgi:app", "--host", "127.0.0.1", "--port", str(port)),
        *("--workers", str(workers), "--loop", "uvloop", "--lifespan", "off"),
        *("--http", "llmquota.api.protocols.httptools_edge:HttpToolsEdgeProtocol"),
        *("--log-level", "warning", "--no-access-log"),
    ]
    return _start(command, dict(os.environ), port), port


def start_baseline(
    redis_host: str,
    redis_port: int,
    client: str,
    app: str = "bench.baseline_app:app",
    workers: int = WORKERS,
) -> Started:
    """A Redis-Lua baseline on uvicorn: FastAPI's (baseline_app.py) or the raw
    ASGI one (raw_baseline_app.py, on httptools and uvloop as `llmquota serve`)."""
    port = free_port()
    env = {
        **os.environ,
        "BENCH_REDIS_HOST": redis_host,
        "BENCH_REDIS_PORT": str(redis_port),
        "BENCH_REDIS_CLIENT": client,
        "BENCH_ADMIN_KEY": ADMIN_KEY,
    }
    command = [
        sys.executable,
        *("-m", "uvicorn", app, "--host", "127.0.0.1"),
        *("--http", "httptools", "--loop", "uvloop", "--no-access-log"),
        *("--port", str(port), "--workers", str(workers), "--log-level", "warning"),
    ]
    return _start(command, env, port), port


_DURATION_UNITS_MS = {"us": 0.001, "ms": 1.0, "s": 1_000.0, "m": 60_000.0}


def _ms(text: str) -> float:
    number, unit = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text.strip()).groups()  # type: ignore[union-attr]
    return float(number) * _DURATION_UNITS_MS[unit]


def run_wrk(
    port: int,
    *,
    system: str,
    workload: str,
    tenants: int,
    connections: int,
    seconds: float,
    lua: str | None = None,
) -> HttpResult:
    """One wrk run (1 thread, so the servers keep the cores); parse its report.

    `lua`: the wrk script, when it is not admissions over `tenants` tenants."""
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write(lua or WRK_SCRIPT.format(key=ADMIN_KEY, tenants=tenants))
    try:
        out = subprocess.run(
            [
                wrk(),
                *("-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--latency"),
                *("-s", script.name, f"http://127.0.0.1:{port}/v1/admit"),
            ],
            capture_output=True,
            text=True,
            check=True,
            timeout=seconds + 60,
        ).stdout
    finally:
        Path(script.name).unlink()
    per_second = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    p50 = _ms(re.search(r"\s50%\s+(\S+)", out).group(1))  # type: ignore[union-attr]
    p99 = _ms(re.search(r"\s99%\s+(\S+)", out).group(1))  # type: ignore[union-attr]
    non_2xx_match = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    return HttpResult(
        system=system,
        workload=workload,
        connections=connections,
        per_second=per_second,
        p50_ms=p50,
        p99_ms=p99,
        non_2xx=int(non_2xx_match.group(1)) if non_2xx_match else 0,
    )


def run_open_loop(
    port: int,
    *,
    system: str,
    tenants: int,
    rate: int,
    seconds: float,
    cpu_of: tuple[int, int] | None = None,
) -> HttpResult:
    """bench/open_loop.py in a process of its own: `rate` requests/s whatever the
    answers, latency from each request's due time (no coordinated omission).

    Given `cpu_of` (the server's pid, the store's pid), also the CPU each
    process tree spent over the run, per request sent.
    """
    before = [process_cpu.tree_cpu_seconds(pid) for pid in cpu_of] if cpu_of else []
    out = subprocess.run(
        [
            sys.executable,
            *("-m", "bench.open_loop", "--port", str(port), "--rate", str(rate)),
            *("--seconds", str(seconds), "--tenants", str(tenants), "--key", ADMIN_KEY),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=seconds + 120,
    ).stdout
    data = json.loads(out.splitlines()[-1])
    per_request = [
        (process_cpu.tree_cpu_seconds(pid) - spent) * 1e6 / data["sent_in_all"]
        for pid, spent in zip(cpu_of or (), before, strict=True)
    ]
    return HttpResult(
        system=system,
        workload=open_loop_workload(rate),
        connections=int(data["connections"]),
        per_second=data["answered"] / data["seconds"],
        p50_ms=float(data["p50_ms"]),
        p99_ms=float(data["p99_ms"]),
        non_2xx=int(data["errors"]),
        server_cpu_us=per_request[0] if per_request else None,
        store_cpu_us=per_request[1] if per_request else None,
    )


def open_loop_workload(rate: int) -> str:
    return f"open loop {rate}/s"


def measure(
    start: Started,
    *,
    system: str,
    workloads: dict[str, int],
    connections: int,
    seconds: float,
    open_loop: tuple[int, int] | None = None,
    store_pid: int | None = None,
) -> list[HttpResult]:
    """Warm a started server up, then measure each workload (and, given
    (tenants, rate), an open-loop run after them, with the CPU per request of
    the server and of the store whose pid is `store_pid`); always stop it."""
    process, port = start
    try:
        # Both workers load their token encodings and open their pools before measuring.
        run_wrk(port, system=system, workload="warm-up", tenants=2, connections=64, seconds=3)
        results = [
            run_wrk(
                port,
                system=system,
                workload=name,
                tenants=count,
                connections=connections,
                seconds=seconds,
            )
            for name, count in workloads.items()
        ]
        if open_loop is not None:
            tenants, rate = open_loop
            results.append(
                run_open_loop(
                    port,
                    system=system,
                    tenants=tenants,
                    rate=rate,
                    seconds=seconds,
                    cpu_of=None if store_pid is None else (process.pid, store_pid),
                )
            )
        return results
    finally:
        stop(process)
