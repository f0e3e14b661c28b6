"""A process's first limiter freezes its start-up heap out of the cyclic
garbage collector (admission/heap.py), once, unless told not to.

Each case runs in a Python process of its own: a freeze is for the life of
a process, and the test process's own heap is not this test's to freeze.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.support import CLI_TIMEOUT_SECONDS

# Connects twice, then reports what the collector says, and how long a full
# collection took before and after the freeze.
PROBE = """
import asyncio, gc, json, sys, time
from llmquota import Limiter

def full_collection_ms():
    started = time.perf_counter()
    gc.collect()
    return (time.perf_counter() - started) * 1000

async def main():
    before = full_collection_ms()
    first = await Limiter.connect(sys.argv[1])
    frozen_by_first = gc.get_freeze_count()
    second = await Limiter.connect(sys.argv[1])
    frozen_by_second = gc.get_freeze_count()
    after = full_collection_ms()
    await first.close()
    await second.close()
    print(json.dumps({"first": frozen_by_first, "second": frozen_by_second,
                      "before_ms": before, "after_ms": after}))

asyncio.run(main())
"""


# The service's worker: the app's start-up connects its limiter.
SERVICE_PROBE = """
import asyncio, gc, json, sys
from llmquota.api.app import create_app
from llmquota.config import Settings

async def main():
    app = create_app(Settings(_env_file=None), dsn=sys.argv[1])
    before = gc.get_freeze_count()
    async with app.router.lifespan_context(app):
        started = gc.get_freeze_count()
    print(json.dumps({"before": before, "started": started}))

asyncio.run(main())
"""


def probe(dsn: str, code: str = PROBE, **environment: str) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-c", code, dsn],
        env={**os.environ, **environment},
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_SECONDS,
        check=True,
    )
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_the_first_limiter_of_a_process_freezes_its_heap_once(app_dsn: str) -> None:
    seen = probe(app_dsn)
    # Everything imported and loaded by then: the libraries alone are tens of
    # thousands of objects.
    assert seen["first"] > 20_000
    # Once per process, not per limiter: the second froze nothing more (the count
    # only falls, as frozen objects are still freed when their last reference goes).
    assert seen["second"] <= seen["first"]
    # A full collection no longer walks them.
    assert seen["after_ms"] < seen["before_ms"] / 2, seen


def test_a_host_that_says_no_keeps_its_collector_as_it_is(app_dsn: str) -> None:
    seen = probe(app_dsn, LLMQUOTA_GC_FREEZE_AT_START="false")
    assert seen["first"] == seen["second"] == 0


def test_a_service_worker_freezes_its_heap_as_it_starts(app_dsn: str) -> None:
    seen = probe(app_dsn, SERVICE_PROBE)
    # The app's own objects (FastAPI, its routes, the proxy's) with the rest.
    assert seen["before"] == 0 and seen["started"] > 50_000, seen
