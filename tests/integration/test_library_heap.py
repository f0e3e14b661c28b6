"""The library leaves its host's garbage collector alone; `settle_after_startup`
is the host's to call (admission/heap.py).

Each case runs in a Python process of its own: a freeze is for the life of
a process, and the test process's own heap is not this test's to freeze.
"""

from __future__ import annotations

import json
import subprocess
import sys

from llmquota.admission.heap import YOUNG_COLLECTION_ALLOCATIONS
from tests.support import CLI_TIMEOUT_SECONDS

# Connects a limiter, reports what the collector says, settles if asked, and
# reports again, with how long a full collection took each time.
PROBE = """
import asyncio, gc, json, sys, time
import llmquota

def full_collection_ms():
    started = time.perf_counter()
    gc.collect()
    return (time.perf_counter() - started) * 1000

def seen():
    return {"frozen": gc.get_freeze_count(), "threshold": gc.get_threshold(),
            "full_ms": min(full_collection_ms() for _ in range(3))}

async def main():
    limiter = await llmquota.Limiter.connect(sys.argv[1])
    connected = seen()
    llmquota.settle_after_startup()
    settled = seen()
    await limiter.close()
    print(json.dumps({"connected": connected, "settled": settled}))

asyncio.run(main())
"""


def test_a_host_that_settles_its_started_process_freezes_it_and_collects_less(
    app_dsn: str,
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, app_dsn],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_SECONDS,
        check=True,
    )
    heap = json.loads(done.stdout.strip().splitlines()[-1])
    connected, settled = heap["connected"], heap["settled"]
    # Connecting changed nothing of the host's collector.
    assert connected["frozen"] == 0
    assert connected["threshold"][0] != YOUNG_COLLECTION_ALLOCATIONS
    # Settling froze the libraries, the limiter and its policy cache ...
    assert settled["frozen"] > 20_000
    assert settled["threshold"] == [YOUNG_COLLECTION_ALLOCATIONS, *connected["threshold"][1:]]
    # ... so a full collection no longer walks them.
    assert settled["full_ms"] < connected["full_ms"] / 2, heap
