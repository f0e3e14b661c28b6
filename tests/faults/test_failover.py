"""Failover: the primary is killed mid-load and its synchronous standby promoted.

One libpq-style URL names both servers, the standby first, with
`target_session_attrs=read-write` (tests/faults/replication.py): `llmquota
migrate` and the library find the primary through it, and after the failover
the promoted standby. With synchronous replication every commit the client
was told of is on the standby before the answer, so nothing acknowledged is
lost: every admission the library returned exists on the new primary, and
every settlement it returned has its ledger row there. Requests in flight at
the kill fail with StoreUnavailable (the tenant's failure mode is closed),
and the library serves again, from the new primary, without a restart.
The same holds for the REST service (`llmquota serve`'s app, in a process of
its own, through the same URL): every 201 and every settled 200 it gave is
on the new primary, and it answers again without a restart.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import asyncpg
import httpx
import pytest

from llmquota.admission.limiter import Limiter
from llmquota.config import Settings
from llmquota.domain.errors import StoreUnavailable
from llmquota.domain.policy import Policy
from llmquota.store import migrate
from tests.faults.conftest import served_process
from tests.faults.replication import Pair, primary_and_standby

pytestmark = pytest.mark.slow

CALLERS = 8
BEFORE_KILL = 150  # settled requests before the primary dies
AFTER_FAILOVER = 150  # settled requests the new primary serves
RECOVERY_SECONDS = 60.0


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Pair]:
    with primary_and_standby(tmp_path / "servers") as started:
        yield started


async def test_a_killed_primary_loses_no_acknowledged_admission_or_ledger_row(pair: Pair) -> None:
    dsn = pair.dsn_of("postgres")
    migrate.upgrade(dsn)  # through the two-host URL: the standby refuses writes
    settings = Settings(decision_deadline_ms=5_000, pool_max_size=4, _env_file=None)  # type: ignore[call-arg]
    limiter = await Limiter.connect(dsn, settings)
    try:
        await limiter.store.put_policy(
            "tenant", "acme", None, Policy(tokens_per_minute=10**9, failure_mode="closed")
        )
        admitted: set[uuid.UUID] = set()
        settled: set[uuid.UUID] = set()
        failures = 0

        async def caller(stop: asyncio.Event) -> None:
            nonlocal failures
            while not stop.is_set():
                try:
                    held = await limiter.admit(
                        tenant="acme", model="gpt-4o", input_tokens=10, max_tokens=20
                    )
                    admitted.add(held.reservation_id)
                    await held.settle(input_tokens=10, output_tokens=5)
                    settled.add(held.reservation_id)
                except StoreUnavailable:
                    failures += 1
                    await asyncio.sleep(0.05)

        await through_failover(pair, caller, settled, "the library")
        # A settlement the store could not take was journaled and answered:
        # it is recorded once the store answers again.
        await _until(lambda: len(limiter.journal) == 0, "the outage journal never drained")
    finally:
        await limiter.close()

    stored, ledger = await on_the_new_primary(pair)
    assert admitted - stored == set(), "acknowledged admissions lost"
    assert settled - ledger == set(), "acknowledged settlements without their ledger row"
    assert len(settled) >= BEFORE_KILL + AFTER_FAILOVER
    print(
        f"FIGURE failover: {len(admitted)} admissions and {len(settled)} settlements "
        f"acknowledged, 0 lost; {failures} calls failed with StoreUnavailable meanwhile"
    )


async def test_the_rest_service_serves_from_the_promoted_standby_and_loses_nothing(
    pair: Pair, tmp_path: Path
) -> None:
    dsn = pair.dsn_of("postgres")
    migrate.upgrade(dsn)
    admin_key = "lq_failover_admin_key_0123456"
    admin = {"Authorization": f"Bearer {admin_key}"}
    admitted: set[uuid.UUID] = set()
    settled: set[uuid.UUID] = set()
    refused: list[int] = []
    async with (
        served_process(dsn, admin_key, tmp_path / "server.log") as (base, _pid),
        httpx.AsyncClient(base_url=base, timeout=30) as client,
    ):
        policy = {"tokens_per_minute": 10**9, "failure_mode": "closed"}
        assert (await client.put("/v1/tenants/acme/policy", json=policy, headers=admin)).is_success
        key = (await client.post("/v1/tenants/acme/keys", headers=admin)).json()["key"]
        headers = {"Authorization": f"Bearer {key}"}
        body = {"tenant": "acme", "model": "gpt-4o", "input_tokens": 10, "max_tokens": 20}

        async def caller(stop: asyncio.Event) -> None:
            while not stop.is_set():
                try:
                    held = await client.post("/v1/admit", json=body, headers=headers)
                    if held.status_code != 201:
                        refused.append(held.status_code)
                        await asyncio.sleep(0.05)
                        continue
                    reservation = uuid.UUID(held.json()["reservation_id"])
                    admitted.add(reservation)
                    done = await client.post(
                        f"/v1/reservations/{reservation}/settle",
                        json={"input_tokens": 10, "output_tokens": 5},
                        headers=headers,
                    )
                    if done.status_code == 200:
                        settled.add(reservation)
                    else:
                        refused.append(done.status_code)
                except httpx.TransportError:
                    refused.append(0)
                    await asyncio.sleep(0.05)

        await through_failover(pair, caller, settled, "the service")

    stored, ledger = await on_the_new_primary(pair)
    assert admitted - stored == set(), "admissions answered 201 lost"
    assert settled - ledger == set(), "settlements answered 200 without their ledger row"
    # Only the store's absence answers otherwise: 503 (failure mode closed).
    assert set(refused) <= {503}, sorted(set(refused))
    print(
        f"FIGURE failover over REST: {len(admitted)} admitted (201) and {len(settled)} "
        f"settled (200), 0 lost; {len(refused)} answers 503 meanwhile"
    )


async def through_failover(
    pair: Pair,
    caller: Callable[[asyncio.Event], Awaitable[None]],
    settled: set[uuid.UUID],
    who: str,
) -> None:
    """CALLERS callers under load until BEFORE_KILL settled, the primary killed and
    the standby promoted, then load until AFTER_FAILOVER more settled."""
    stop = asyncio.Event()
    callers = [asyncio.create_task(caller(stop)) for _ in range(CALLERS)]
    await _until(lambda: len(settled) >= BEFORE_KILL, "the load never got going")
    before_kill = len(settled)
    await asyncio.to_thread(pair.fail_over)
    await _until(
        lambda: len(settled) >= before_kill + AFTER_FAILOVER,
        f"{who} never served from the promoted standby",
    )
    stop.set()
    await asyncio.gather(*callers)


async def on_the_new_primary(pair: Pair) -> tuple[set[uuid.UUID], set[uuid.UUID]]:
    """The reservations the promoted standby holds, and those with a usage row."""
    promoted = await asyncpg.connect(pair.standby.dsn_of("postgres"))
    try:
        assert not await promoted.fetchval("SELECT pg_is_in_recovery()")
        stored = {r[0] for r in await promoted.fetch("SELECT reservation_id FROM reservations")}
        ledger = {
            r[0]
            for r in await promoted.fetch(
                "SELECT reservation_id FROM usage_ledger WHERE entry_kind = 'usage'"
            )
        }
    finally:
        await promoted.close()
    return stored, ledger


async def _until(condition: object, failure: str) -> None:
    assert callable(condition)
    deadline = time.monotonic() + RECOVERY_SECONDS
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(failure)
        await asyncio.sleep(0.05)
