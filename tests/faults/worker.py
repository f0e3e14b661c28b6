"""A gateway worker run as a subprocess by the fault tests.

It opens a Limiter on the DSN given as argv[1] (settings from LLMQUOTA_*),
prints {"ready": true}, then reads one JSON command per line on stdin and
prints one JSON answer per line. The tests pause it (SIGSTOP), kill it (-9)
or skew its clock (libfaketime) and then look at what the database holds.

Commands: admit (keyword arguments of Limiter.admit), settle, release,
heartbeat, sweep, clock (the worker's own wall clock), exit.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from datetime import datetime
from typing import Any

from llmquota.admission.limiter import Limiter
from llmquota.config import Settings
from llmquota.domain.errors import LimiterError, RateLimited


def _json(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    return value


async def run(limiter: Limiter, command: dict[str, Any]) -> dict[str, Any]:
    op = command.pop("op")
    if op == "admit":
        count = int(command.pop("count", 1))
        admitted = []
        refused = []
        for _ in range(count):
            try:
                r = await limiter.admit(**command)
            except RateLimited as exc:
                refused.append({"error": "RateLimited", "limit": exc.limit, "scope": exc.scope})
                continue
            except LimiterError as exc:
                refused.append({"error": type(exc).__name__, "message": str(exc)})
                continue
            admitted.append(
                {
                    "reservation_id": str(r.reservation_id),
                    "reserved_tokens": r.reserved_tokens,
                    "lease_expires_at": r.lease_expires_at.isoformat(),
                }
            )
        return {"admitted": admitted, "refused": refused}
    try:
        if op == "settle":
            s = await limiter.settle(
                uuid.UUID(command["reservation_id"]),
                input_tokens=command["input_tokens"],
                output_tokens=command["output_tokens"],
            )
            return {"charged_tokens": s.charged_tokens, "late": s.late}
        if op == "release":
            await limiter.release(uuid.UUID(command["reservation_id"]))
            return {"released": True}
        if op == "heartbeat":
            h = await limiter.heartbeat(
                uuid.UUID(command["reservation_id"]),
                lease_generation=command.get("lease_generation"),
            )
            return {"lease_expires_at": _json(h.lease_expires_at), "generation": h.lease_generation}
        if op == "sweep":
            report = await limiter.sweep()
            return {"expired": report.expired}
        if op == "clock":
            return {"wall": time.time(), "now": datetime.now().isoformat()}
    except LimiterError as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    raise ValueError(f"unknown op {op!r}")


async def main(dsn: str) -> None:
    limiter = await Limiter.connect(dsn, Settings())
    loop = asyncio.get_running_loop()
    print(json.dumps({"ready": True, "pid_wall_clock": time.time()}), flush=True)
    try:
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line or not line.strip():
                break
            command = json.loads(line)
            if command.get("op") == "exit":
                break
            print(json.dumps(await run(limiter, command), default=_json), flush=True)
    finally:
        await limiter.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
