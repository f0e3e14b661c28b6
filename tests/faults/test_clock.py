"""Worker clocks play no part: a worker three days behind (and one a year
ahead) makes exactly the decisions of a worker with the right time.

The skewed workers run under libfaketime, preloaded from the copy the PyPI
package `libfaketime` ships (a dev dependency, so no system package is
needed). It shifts every wall-clock call of the process, C code included; the
monotonic clock is left alone so that asyncio's timers work. Each worker drives
the same script against its own fresh database; the decisions must be
identical and every lease must be measured on the database clock.
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from llmquota.admission.limiter import Limiter
from tests.conftest import _admin, audit_findings, dsn_with_database
from tests.faults.conftest import Worker, fault_settings, put

SKEWS = {"true": None, "three days behind": "-3d", "a year ahead": "+365d"}
LEASE_SECONDS = 60


def _libfaketime() -> str:
    """The libfaketime.so.1 inside the `libfaketime` package, found without importing it."""
    spec = importlib.util.find_spec("libfaketime")
    assert spec and spec.submodule_search_locations, (
        "the libfaketime package is needed: pip install -e '.[dev]'"
    )
    (package,) = spec.submodule_search_locations
    library = Path(package, "vendor", "libfaketime", "src", "libfaketime.so.1")
    assert library.is_file(), f"the libfaketime package ships no {library}"
    return str(library)


def _skewed(skew: str) -> dict[str, str]:
    """What `faketime -f SKEW` puts in a command's environment, less its shared
    memory (which only keeps "start at" times in step across child processes;
    a relative offset needs none): the library preloaded, the offset in FAKETIME.
    """
    preload = [*filter(None, os.environ.get("LD_PRELOAD", "").split(":")), _libfaketime()]
    return {"LD_PRELOAD": ":".join(preload), "FAKETIME": skew}


@pytest.fixture
async def databases(server_dsn: str, template_database: str) -> AsyncIterator[dict[str, str]]:
    """One fresh database per clock."""
    names = {clock: f"llmquota_clock_{i}_{time.time_ns()}" for i, clock in enumerate(SKEWS)}
    for name in names.values():
        await _admin(server_dsn, f'CREATE DATABASE "{name}" TEMPLATE "{template_database}"')
    yield {clock: dsn_with_database(server_dsn, name) for clock, name in names.items()}
    for name in names.values():
        await _admin(server_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def _script(worker: Worker, dsn: str) -> dict[str, Any]:
    """The same requests, in the same order; the answers, normalised."""
    admitted = await worker.call(
        op="admit",
        tenant="acme",
        model="m",
        input_tokens=0,
        max_tokens=100,
        lease_seconds=LEASE_SECONDS,
        count=12,
    )
    ids = [a["reservation_id"] for a in admitted["admitted"]]
    swept = await worker.call(op="sweep")
    beat = await worker.call(op="heartbeat", reservation_id=ids[0])
    settled = await worker.call(
        op="settle", reservation_id=ids[1], input_tokens=0, output_tokens=40
    )
    clock = await worker.call(op="clock")
    connection = await asyncpg.connect(dsn)
    try:
        lease_left = await connection.fetch(
            "SELECT extract(epoch FROM lease_expires_at - clock_timestamp()) AS s "
            "FROM reservations WHERE state = 'active'"
        )
        remaining = await connection.fetchval(
            "SELECT floor(tokens) FROM limit_layers WHERE tenant = 'acme'"
        )
    finally:
        await connection.close()
    return {
        "decisions": {
            "admitted": len(ids),
            "refused": admitted["refused"],
            "swept": swept,
            "heartbeat_ok": "error" not in beat,
            "settled": settled,
            "remaining_tokens": remaining,
            "active": len(lease_left),
            "leases_measured_by_the_database": all(
                LEASE_SECONDS - 30 < row["s"] <= LEASE_SECONDS for row in lease_left
            ),
        },
        "worker_wall_clock": clock["wall"],
    }


async def test_skewed_worker_clocks_make_identical_decisions(
    databases: dict[str, str],
) -> None:
    results = {}
    for clock, skew in SKEWS.items():
        dsn = databases[clock]
        admin = await Limiter.connect(dsn, fault_settings())
        # 1,000 tokens of capacity, a token a minute: 10 reservations of 100 fit.
        await put(admin, "tenant", "acme", tokens_per_minute=1, token_burst=1_000)
        await admin.close()
        skewed = _skewed(skew) if skew else {}
        worker = await Worker.start(dsn, FAKETIME_DONT_FAKE_MONOTONIC="1", **skewed)
        try:
            results[clock] = await _script(worker, dsn)
        finally:
            await worker.stop()

    truth = results["true"]
    now = time.time()
    assert abs(truth["worker_wall_clock"] - now) < 60
    # The skew is real ...
    assert truth["worker_wall_clock"] - results["three days behind"]["worker_wall_clock"] > (
        3 * 86_400 - 120
    )
    assert results["a year ahead"]["worker_wall_clock"] - now > 364 * 86_400
    # ... and changes nothing.
    assert truth["decisions"]["admitted"] == 10
    assert truth["decisions"]["swept"] == {"expired": 0}
    assert truth["decisions"]["settled"] == {"charged_tokens": 40, "late": False}
    assert truth["decisions"]["leases_measured_by_the_database"]
    for clock in SKEWS:
        assert results[clock]["decisions"] == truth["decisions"], clock
        assert await audit_findings(databases[clock]) == []
    print(f"FIGURE clock: decisions under every skew: {truth['decisions']}")
    print(
        "FIGURE clock: worker clocks "
        + ", ".join(
            f"{c}={datetime.fromtimestamp(r['worker_wall_clock']).isoformat(timespec='seconds')}"
            for c, r in results.items()
        )
    )
