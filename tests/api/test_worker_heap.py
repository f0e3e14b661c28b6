"""A server worker freezes its heap once started; an app built elsewhere leaves the collector be.

Each case runs in a process of its own: freezing is process-wide, and the
test process builds many apps.
"""

from __future__ import annotations

import json
import subprocess
import sys

from llmquota.admission.heap import YOUNG_COLLECTION_ALLOCATIONS

SCRIPT = """
import asyncio, gc, json, sys
from llmquota.api.app import create_app
from llmquota.config import Settings

async def main() -> None:
    before = {"frozen": gc.get_freeze_count(), "threshold": gc.get_threshold()}
    app = create_app(Settings(database_url=sys.argv[1]), server_worker=sys.argv[2] == "worker")
    async with app.router.lifespan_context(app):
        during = {"frozen": gc.get_freeze_count(), "threshold": gc.get_threshold()}
    print(json.dumps({"before": before, "during": during}))

asyncio.run(main())
"""


def heap_of(database_dsn: str, role: str) -> dict[str, dict[str, int | list[int]]]:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, database_dsn, role],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    heap: dict[str, dict[str, int | list[int]]] = json.loads(out.strip().splitlines()[-1])
    return heap


def test_a_server_worker_freezes_what_start_up_made_and_collects_young_objects_less_often(
    database_dsn: str,
) -> None:
    heap = heap_of(database_dsn, "worker")
    assert heap["before"]["frozen"] == 0
    # Modules, the app, its routes and validators, the limiter: far more than a few.
    assert heap["during"]["frozen"] > 50_000
    before, during = heap["before"]["threshold"], heap["during"]["threshold"]
    assert isinstance(before, list) and isinstance(during, list)
    assert during == [YOUNG_COLLECTION_ALLOCATIONS, *before[1:]]


def test_an_app_built_outside_a_server_worker_leaves_the_collector_as_it_was(
    database_dsn: str,
) -> None:
    heap = heap_of(database_dsn, "library")
    assert heap["during"] == heap["before"]
    assert heap["during"]["frozen"] == 0
