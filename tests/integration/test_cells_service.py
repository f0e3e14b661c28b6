"""The service over a database of cells (api/cells_front.py), over real sockets.

`llmquota serve` at the `public` DSN of a database of cells runs a service
per cell behind a front that sends each request to its tenant's cell. Here,
with a real uvicorn server and two cells (on CI's Citus leg, one on each
worker): each tenant's reservations are written, settled and swept in its
own cell; the global policy and a ceiling are written as slices and read
whole; concurrent admits over both cells never pass the global burst and,
with the rebalancer's rounds, reach it exactly; what no cell answers alone
is refused with 501; and the CLI serves the cells at the `public` DSN.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from llmquota.admin.ceilings_over_cells import ceiling_alerts_of_the_deployment
from llmquota.admin.running import maintenance_running
from llmquota.admin.service import AdminService
from llmquota.admission.limiter import Limiter
from llmquota.api.cells_front import CellsFront
from llmquota.config import Settings
from llmquota.domain.cell_hints import hinted_cell, with_cell_hint
from llmquota.domain.cells import cell_of
from llmquota.metrics import Metrics
from llmquota.store.alerts import AlertStore
from llmquota.store.cells import build_cells, cell_named_in, in_cell
from llmquota.store.leader import LeaderLock
from llmquota.store.store import Store
from tests.api.conftest import ADMIN_KEY, api_settings
from tests.faults.conftest import worker_env
from tests.ports import reserved_port
from tests.proxy.conftest import serving
from tests.receiver import Receiver
from tests.support import APP_ROLE, dsn_as, run_cli

pytestmark = pytest.mark.citus

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
CELLS = 2
TENANTS = [f"tenant-{i:02d}" for i in range(40)]
IN_CELL = {k: [t for t in TENANTS if cell_of(t, CELLS) == k] for k in (1, 2)}
ONE, TWO = IN_CELL[1][0], IN_CELL[2][0]
REQUEST = {"model": "gpt-4o", "input_tokens": 100, "max_tokens": 900}  # 1,000 tokens


def front_settings() -> Settings:
    """The API tests' settings, with each cell's sweeper on (tests/conftest.py
    turns it off for the other tests) and quick."""
    return api_settings(serve_sweeper=True, sweep_interval_seconds=0.5)


@pytest.fixture
async def cells_dsn(empty_database_dsn: str) -> str:
    await asyncio.to_thread(build_cells, empty_database_dsn, CELLS)
    return empty_database_dsn


@pytest.fixture
async def client(cells_dsn: str) -> AsyncIterator[httpx.AsyncClient]:
    front = CellsFront(front_settings(), dsn_as(cells_dsn, APP_ROLE))
    async with serving(front) as url, httpx.AsyncClient(base_url=url, timeout=60) as c:
        yield c


@pytest.fixture
async def db(cells_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    connection = await asyncpg.connect(cells_dsn)
    yield connection
    await connection.close()


async def put_tenants(client: httpx.AsyncClient, tenants: list[str]) -> None:
    for tenant in tenants:
        answer = await client.put(
            f"/v1/tenants/{tenant}/policy",
            json={"tokens_per_minute": 1, "token_burst": 1_000_000},
            headers=ADMIN,
        )
        assert answer.status_code == 200, answer.text


async def states(db: asyncpg.Connection, cell: int) -> dict[str, list[str]]:
    """Each tenant's reservation states in cell `cell`."""
    rows = await db.fetch(
        f"SELECT tenant, state FROM cell_{cell}.reservations ORDER BY created_at, tenant"
    )
    found: dict[str, list[str]] = {}
    for row in rows:
        found.setdefault(row["tenant"], []).append(row["state"])
    return found


async def test_each_tenants_requests_are_decided_settled_and_swept_in_its_own_cell(
    client: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    await put_tenants(client, [ONE, TWO])
    # The admin key: the body's tenant says the cell.
    held = {}
    for tenant in (ONE, TWO):
        answer = await client.post("/v1/admit", json={**REQUEST, "tenant": tenant}, headers=ADMIN)
        assert answer.status_code == 201, answer.text
        held[tenant] = answer.json()["reservation_id"]
    assert await states(db, 1) == {ONE: ["active"]}
    assert await states(db, 2) == {TWO: ["active"]}
    # A settle with the admin key finds the reservation in whichever cell holds it.
    settled = await client.post(
        f"/v1/reservations/{held[TWO]}/settle",
        json={"input_tokens": 100, "output_tokens": 150},
        headers=ADMIN,
    )
    assert settled.status_code == 200, settled.text
    assert settled.json()["charged_tokens"] == 250
    released = await client.post(f"/v1/reservations/{held[ONE]}/release", headers=ADMIN)
    assert released.status_code == 200, released.text
    unknown = await client.post(
        "/v1/reservations/00000000-0000-4000-8000-000000000000/release", headers=ADMIN
    )
    assert unknown.status_code == 404
    # A tenant's key lives in its tenant's cell, and its requests go there.
    made = await client.post(f"/v1/tenants/{TWO}/keys", headers=ADMIN)
    assert made.status_code == 201, made.text
    key = {"Authorization": f"Bearer {made.json()['key']}"}
    by_key = await client.post("/v1/admit", json={**REQUEST, "tenant": TWO}, headers=key)
    assert by_key.status_code == 201, by_key.text
    assert (
        await db.fetchval(
            "SELECT tenant FROM cell_2.reservations WHERE reservation_id = $1",
            by_key.json()["reservation_id"],
        )
        == TWO
    )
    other = await client.post("/v1/admit", json={**REQUEST, "tenant": ONE}, headers=key)
    assert other.status_code == 403  # its own cell says the key is not ONE's
    bad_key = await client.post(
        "/v1/admit", json={**REQUEST, "tenant": TWO}, headers={"Authorization": "Bearer x"}
    )
    assert bad_key.status_code == 401
    # Each cell's sweeper expires its own cell's dead reservations.
    for tenant in (ONE, TWO):
        answer = await client.post(
            "/v1/admit", json={**REQUEST, "tenant": tenant, "lease_seconds": 1}, headers=ADMIN
        )
        assert answer.status_code == 201, answer.text
    deadline = time.monotonic() + 30
    while True:
        swept = [(await states(db, k))[t][-1] for k, t in ((1, ONE), (2, TWO))]
        if swept == ["expired", "expired"]:
            break
        assert time.monotonic() < deadline, f"not swept in 30 s: {swept}"
        await asyncio.sleep(0.2)
    ledger = await db.fetchval(
        "SELECT (SELECT count(*) FROM cell_1.usage_ledger) * 10"
        " + (SELECT count(*) FROM cell_2.usage_ledger)"
    )
    assert ledger == 1 * 10 + 2  # the swept one in cell 1; the settled and swept in cell 2


async def test_an_admin_keys_settle_asks_the_cell_its_reservation_id_names_and_no_other(
    cells_dsn: str, db: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, it asked each cell in turn: a 404 from every cell before the
    # one that held it (and for a slice's id, a journal interval's wait in
    # each). Each cell's service now names its cell in the ids it makes.
    front = CellsFront(front_settings(), dsn_as(cells_dsn, APP_ROLE))
    asked: list[tuple[str, int]] = []
    call = front._call

    async def recorded(index: int, scope: Any, body: bytes, receive: Any) -> Any:
        asked.append((scope["path"].rsplit("/", 1)[-1], index))
        return await call(index, scope, body, receive)

    monkeypatch.setattr(front, "_call", recorded)
    async with serving(front) as url, httpx.AsyncClient(base_url=url, timeout=60) as client:
        await put_tenants(client, [ONE, TWO])
        for cell, tenant in ((1, ONE), (2, TWO)):
            for action in ("heartbeat", "settle"):
                admitted = await client.post(
                    "/v1/admit", json={**REQUEST, "tenant": tenant}, headers=ADMIN
                )
                assert admitted.status_code == 201, admitted.text
                reservation = uuid.UUID(admitted.json()["reservation_id"])
                assert hinted_cell(reservation, CELLS) == cell - 1
                asked.clear()
                body = {"input_tokens": 100, "output_tokens": 150} if action == "settle" else {}
                answer = await client.post(
                    f"/v1/reservations/{reservation}/{action}", json=body, headers=ADMIN
                )
                assert answer.status_code == 200, answer.text
                assert asked == [(action, cell - 1)]
        # An id no cell made still finds its answer, from every cell in turn.
        asked.clear()
        unknown = uuid.UUID(int=with_cell_hint(uuid.uuid4().int, 1))
        answer = await client.post(f"/v1/reservations/{unknown}/release", headers=ADMIN)
        assert answer.status_code == 404
        assert asked == [("release", 1), ("release", 0)]
    settled = await db.fetchval(
        "SELECT (SELECT count(*) FROM cell_1.usage_ledger) * 10"
        " + (SELECT count(*) FROM cell_2.usage_ledger)"
    )
    assert settled == 1 * 10 + 1


async def test_shared_limits_are_written_as_slices_and_read_whole(
    client: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    written = await client.put(
        "/v1/policies/global", json={"tokens_per_minute": 7, "token_burst": 10_001}, headers=ADMIN
    )
    assert written.status_code == 200, written.text
    assert (written.json()["tokens_per_minute"], written.json()["token_burst"]) == (7, 10_001)
    assert "etag" not in written.headers  # each cell's version is its own
    slices = [
        await db.fetchrow(
            f"SELECT tokens_per_minute, token_burst FROM cell_{k}.limit_layers"
            " WHERE scope = 'global'"
        )
        for k in (1, 2)
    ]
    assert [tuple(s) for s in slices if s] == [(4, 5_001), (3, 5_000)]
    read = await client.get("/v1/policies/global", headers=ADMIN)
    assert (read.json()["tokens_per_minute"], read.json()["token_burst"]) == (7, 10_001)
    # A limit that cannot be split is refused before any cell is written.
    refused = await client.put(
        "/v1/policies/global", json={"tokens_per_minute": 1, "token_burst": 10}, headers=ADMIN
    )
    assert refused.status_code == 422, refused.text
    assert "number of cells" in refused.json()["error"]["message"]
    again = await client.get("/v1/policies/global", headers=ADMIN)
    assert again.json()["token_burst"] == 10_001
    patched = await client.patch(
        "/v1/policies/global",
        json={"token_burst": 9_000},
        headers={**ADMIN, "content-type": "application/merge-patch+json"},
    )
    assert patched.status_code == 200, patched.text
    assert (patched.json()["tokens_per_minute"], patched.json()["token_burst"]) == (7, 9_000)
    # A provider ceiling: slices too, with its balances added up.
    ceiling = {"models": ["gpt-4o"], "tokens_per_minute": 60_000, "max_in_flight": 9}
    put = await client.put("/v1/ceilings/openai", json=ceiling, headers=ADMIN)
    assert put.status_code == 200, put.text
    whole = (await client.get("/v1/ceilings/openai", headers=ADMIN)).json()
    assert (whole["tokens_per_minute"], whole["token_burst"], whole["max_in_flight"]) == (
        60_000,
        60_000,
        9,
    )
    assert whole["remaining_tokens"] == 60_000 and whole["in_flight"] == 0
    (listed,) = (await client.get("/v1/ceilings", headers=ADMIN)).json()["ceilings"]
    assert (listed["ceiling"], listed["token_burst"], listed["remaining_tokens"]) == (
        "openai",
        60_000,
        60_000,
    )
    ceilings = "limit_layers WHERE scope = 'ceiling'"
    bursts = [await db.fetchval(f"SELECT token_burst FROM cell_{k}.{ceilings}") for k in (1, 2)]
    assert sorted(bursts) == [30_000, 30_000]
    assert (await client.delete("/v1/ceilings/openai", headers=ADMIN)).status_code == 204
    for k in (1, 2):
        assert await db.fetchval(f"SELECT count(*) FROM cell_{k}.{ceilings}") == 0
    # A plan is a tenant's limits: every cell holds it whole.
    plan = await client.put("/v1/plans/pro", json={"tokens_per_minute": 5_000}, headers=ADMIN)
    assert plan.status_code == 200, plan.text
    for k in (1, 2):
        assert await db.fetchval(f"SELECT count(*) FROM cell_{k}.plans WHERE plan = 'pro'") == 1
    read_plan = await client.get("/v1/plans/pro", headers=ADMIN)
    assert read_plan.json()["tokens_per_minute"] == 5_000
    assert "etag" not in read_plan.headers  # each cell's copy has its own version
    # An If-Match cannot stand for every cell's version: refused, nothing written.
    guarded = await client.put(
        "/v1/plans/pro", json={"tokens_per_minute": 1}, headers={**ADMIN, "If-Match": '"1"'}
    )
    assert guarded.status_code == 412, guarded.text
    # A whole number written as 60000.0 is split as 60000 is.
    floats = await client.put(
        "/v1/policies/global", json={"tokens_per_minute": 60_000.0}, headers=ADMIN
    )
    assert floats.status_code == 200, floats.text
    assert floats.json()["tokens_per_minute"] == 60_000
    # A body over the size limit is refused whole by the front: no cell sees part of it.
    huge = await client.put(
        "/v1/plans/pro",
        content=b'{"tokens_per_minute": 1, "pad": "' + b"x" * 2_000_000 + b'"}',
        headers={**ADMIN, "content-type": "application/json"},
    )
    assert huge.status_code == 413, huge.text
    for k in (1, 2):
        assert (
            await db.fetchval(f"SELECT tokens_per_minute FROM cell_{k}.plans WHERE plan = 'pro'")
            == 5_000
        )


async def test_a_ceilings_alert_watches_its_slices_added_up_and_fires_once(
    cells_dsn: str, db: asyncpg.Connection
) -> None:
    # Each cell's service watched its own slice: a slice at 90% alerted while
    # the ceiling was at 45%, and a crossing of the whole alerted once per cell.
    settings = api_settings(ceiling_alert_interval_seconds=0.1).model_copy(
        update={"ceiling_alerts": True}
    )
    front = CellsFront(settings, dsn_as(cells_dsn, APP_ROLE))
    ceiling = {"models": ["gpt-4o"], "tokens_per_minute": 2, "token_burst": 10_000}
    alerts = "SELECT count(*) FROM cell_{}.alert_outbox WHERE event_type = 'ceiling.utilization'"
    episodes = "SELECT count(*) FROM cell_{}.ceiling_alert_episodes WHERE episode_start IS NOT NULL"
    async with serving(front) as url, httpx.AsyncClient(base_url=url, timeout=60) as client:
        await put_tenants(client, [ONE, TWO])
        put = await client.put(
            "/v1/ceilings/openai", json={**ceiling, "alert_at": [0.8]}, headers=ADMIN
        )
        assert put.status_code == 200, put.text
        nine_tenths = {"model": "gpt-4o", "input_tokens": 100, "max_tokens": 4_400}
        first = await client.post("/v1/admit", json={**nine_tenths, "tenant": ONE}, headers=ADMIN)
        assert first.status_code == 201, first.text
        whole = (await client.get("/v1/ceilings/openai", headers=ADMIN)).json()
        assert whole["utilization"] == pytest.approx(0.45, abs=0.001)
        await asyncio.sleep(1.0)  # ten rounds of the detector
        assert [await db.fetchval(alerts.format(k)) for k in (1, 2)] == [0, 0]
        assert [await db.fetchval(episodes.format(k)) for k in (1, 2)] == [0, 0]

        # 4,000 more, wherever the rebalancer has moved the room by now: 85% of the whole.
        admitted, deadline = 0, time.monotonic() + 20
        while admitted < 4:
            assert time.monotonic() < deadline, f"only {admitted} of 4 more admitted in 20 s"
            tenant = (ONE, TWO)[admitted % 2]
            more = await client.post("/v1/admit", json={**REQUEST, "tenant": tenant}, headers=ADMIN)
            assert more.status_code in (201, 429), more.text
            admitted += more.status_code == 201
            await asyncio.sleep(0 if more.status_code == 201 else 0.2)
        deadline = time.monotonic() + 10
        while await db.fetchval(alerts.format(1)) == 0:
            assert time.monotonic() < deadline, "no alert at 85% of the whole ceiling in 10 s"
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)
        assert [await db.fetchval(alerts.format(k)) for k in (1, 2)] == [1, 0]
        assert [await db.fetchval(episodes.format(k)) for k in (1, 2)] == [1, 0]
        (utilization,) = await db.fetch(
            "SELECT utilization FROM cell_1.ceiling_alert_episodes WHERE episode_start IS NOT NULL"
        )
        assert utilization["utilization"] == pytest.approx(0.85, abs=0.001)


async def test_sweep_loop_over_cells_watches_each_ceiling_whole_and_delivers_its_alert_once(
    cells_dsn: str, db: asyncpg.Connection, tmp_path: Path
) -> None:
    # `llmquota sweep --loop` at the database's DSN ran a detector per cell,
    # each on its slice: the same per-slice alerts as the service had.
    receiver = await Receiver().start()
    settings = api_settings(webhook_allowed_networks="127.0.0.0/8")
    front = CellsFront(settings, dsn_as(cells_dsn, APP_ROLE))
    log = tmp_path / "sweep.log"
    sweep = None
    try:
        async with serving(front) as url, httpx.AsyncClient(base_url=url, timeout=60) as client:
            await put_tenants(client, [ONE, TWO])
            ceiling = {"models": ["gpt-4o"], "tokens_per_minute": 2, "token_burst": 10_000}
            put = await client.put(
                "/v1/ceilings/openai", json={**ceiling, "alert_at": [0.8]}, headers=ADMIN
            )
            assert put.status_code == 200, put.text
            hook = {"url": receiver.url, "secret": "whsec_cells_sweep_0123"}
            made = await client.put("/v1/webhooks/ops", json=hook, headers=ADMIN)
            assert made.status_code == 201, made.text
            with log.open("ab") as out:
                sweep = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "llmquota.cli", "sweep", "--loop", "5",
                    stdout=out, stderr=out,
                    env=worker_env(
                        LLMQUOTA_DATABASE_URL=dsn_as(cells_dsn, APP_ROLE),
                        LLMQUOTA_CEILING_ALERT_INTERVAL_SECONDS="0.05",
                        LLMQUOTA_ALERT_DELIVERY_INTERVAL_SECONDS="0.05",
                        LLMQUOTA_WEBHOOK_ALLOWED_NETWORKS="127.0.0.0/8",
                    ),
                )  # fmt: skip
            deadline = time.monotonic() + 60
            while "swept:" not in log.read_text(errors="replace"):
                assert time.monotonic() < deadline, log.read_text(errors="replace")
                await asyncio.sleep(0.1)
            # 90% of cell 1's slice, 45% of the ceiling: no alert.
            nine_tenths = {"model": "gpt-4o", "input_tokens": 100, "max_tokens": 4_400}
            first = await client.post(
                "/v1/admit", json={**nine_tenths, "tenant": ONE}, headers=ADMIN
            )
            assert first.status_code == 201, first.text
            await asyncio.sleep(1.0)
            assert receiver.delivered() == []
            # 85% of the whole: one alert, delivered once.
            admitted, deadline = 0, time.monotonic() + 20
            while admitted < 4:
                assert time.monotonic() < deadline, f"only {admitted} of 4 more admitted"
                more = await client.post(
                    "/v1/admit", json={**REQUEST, "tenant": (ONE, TWO)[admitted % 2]}, headers=ADMIN
                )
                assert more.status_code in (201, 429), more.text
                admitted += more.status_code == 201
                await asyncio.sleep(0 if more.status_code == 201 else 0.2)
            deadline = time.monotonic() + 20
            while not receiver.delivered():
                assert time.monotonic() < deadline, log.read_text(errors="replace")
                await asyncio.sleep(0.1)
            await asyncio.sleep(1.0)
    finally:
        if sweep is not None and sweep.returncode is None:
            sweep.send_signal(signal.SIGTERM)
            await sweep.wait()
        await receiver.stop()
    (event,) = [r.json() for r in receiver.delivered()]
    assert (event["ceiling"], event["threshold"]) == ("openai", "0.8")
    alerts = "SELECT count(*) FROM cell_{}.alert_outbox WHERE event_type = 'ceiling.utilization'"
    assert [await db.fetchval(alerts.format(k)) for k in (1, 2)] == [1, 0]


async def test_concurrent_admits_over_both_cells_never_pass_the_global_burst(
    client: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    tenants = IN_CELL[1][:10] + IN_CELL[2][:10]
    await put_tenants(client, tenants)
    # 20 requests' worth, 10 a cell; a refill of 2 tokens a minute adds nothing here.
    glob = {"tokens_per_minute": CELLS, "token_burst": 20 * 1_000}
    assert (await client.put("/v1/policies/global", json=glob, headers=ADMIN)).status_code == 200

    async def admit(tenant: str) -> int:
        answer = await client.post("/v1/admit", json={**REQUEST, "tenant": tenant}, headers=ADMIN)
        assert answer.status_code in (201, 429), answer.text
        return answer.status_code

    # Cell 1's tenants ask for 3 times the whole burst; cell 2's for little.
    first = await asyncio.gather(
        *(admit(t) for t in IN_CELL[1][:10] * 6), *(admit(t) for t in IN_CELL[2][:2])
    )
    admitted = first.count(201)
    assert admitted <= 20
    # The rebalancer moves most of cell 2's unused room to cell 1 within a few
    # rounds (each slice keeps a reserve for demand that starts between rounds).
    # Until nothing more is admitted for 5 s: then each slice holds less than
    # a request, so at most one request's worth is stranded over the two.
    deadline, last = time.monotonic() + 60, time.monotonic()
    while time.monotonic() - last < 5:
        assert time.monotonic() < deadline, f"still admitting after 60 s: {admitted}"
        await asyncio.sleep(0.5)
        more = await asyncio.gather(*(admit(t) for t in IN_CELL[1][:10] + IN_CELL[2][:2]))
        if more.count(201):
            admitted, last = admitted + more.count(201), time.monotonic()
        assert admitted <= 20
    assert admitted >= 19, admitted
    # Nothing was made or lost: the slices' room and what the active
    # reservations hold add up to the burst (and a few seconds' refill at 2
    # tokens a minute), once no move is in flight.
    while await db.fetchval(
        "SELECT (SELECT count(*) FROM cell_1.budget_transfers"
        "        WHERE direction = 'out' AND delivered_at IS NULL)"
        " + (SELECT count(*) FROM cell_2.budget_transfers"
        "        WHERE direction = 'out' AND delivered_at IS NULL)"
    ):
        assert time.monotonic() < deadline + 30, "a move was never delivered"
        await asyncio.sleep(0.2)
    room = 0.0
    for k in (1, 2):
        room += await db.fetchval(
            f"SELECT cell_{k}.lq_refilled(tokens, tokens_per_minute, token_burst, refilled_at,"
            f" clock_timestamp()) FROM cell_{k}.limit_layers WHERE scope = 'global'"
        )
    active = await db.fetchval(
        "SELECT (SELECT coalesce(sum(reserved_tokens), 0) FROM cell_1.reservations"
        "        WHERE state = 'active')"
        " + (SELECT coalesce(sum(reserved_tokens), 0) FROM cell_2.reservations"
        "        WHERE state = 'active')"
    )
    assert active == admitted * 1_000
    assert 20_000 <= float(room) + int(active) <= 20_000 + 5, (room, active)


async def test_a_tenant_key_on_an_admin_path_is_refused_by_its_own_cell_and_costs_no_budget(
    cells_dsn: str,
) -> None:
    # Sent to every cell, a tenant's valid key was a failed authentication
    # (401) in each other cell, counted against its client: a gateway that
    # polled the directory with one spent its address's budget, then got 429.
    settings = api_settings(auth_failure_burst=3, auth_failures_per_second=0.001)
    front = CellsFront(settings, dsn_as(cells_dsn, APP_ROLE))
    async with serving(front) as url, httpx.AsyncClient(base_url=url, timeout=60) as client:
        await put_tenants(client, [ONE, TWO])
        made = await client.post(f"/v1/tenants/{TWO}/keys", headers=ADMIN)
        assert made.status_code == 201, made.text
        key = {"Authorization": f"Bearer {made.json()['key']}"}
        global_policy = {"tokens_per_minute": 1_000, "token_burst": 1_000}
        statuses = []
        for _ in range(3):
            statuses += [
                (await client.get("/v1/tenants", headers=key)).status_code,
                (await client.get("/v1/policies/global", headers=key)).status_code,
                (
                    await client.put("/v1/policies/global", json=global_policy, headers=key)
                ).status_code,
                (await client.get("/v1/ceilings", headers=key)).status_code,
                (await client.get("/v1/plans", headers=key)).status_code,
            ]
        assert statuses == [403] * 15
        # The client's budget of failed authentications is whole: three wrong keys, then 429.
        wrong = {"Authorization": "Bearer lq_not_a_key"}
        answers = [(await client.get("/v1/tenants", headers=wrong)).status_code for _ in range(4)]
        assert answers == [401, 401, 401, 429]
        admitted = await client.post("/v1/admit", json={**REQUEST, "tenant": TWO}, headers=key)
        assert admitted.status_code == 201, admitted.text


async def test_an_admin_key_stored_in_one_cell_is_refused_and_writes_nothing(
    cells_dsn: str, db: asyncpg.Connection, client: httpx.AsyncClient
) -> None:
    # A service of cell 1 alone, started without LLMQUOTA_ADMIN_KEY, stores an
    # admin key there. Handed to cell 1, it wrote a ceiling whole into its slice.
    async with await Limiter.connect(in_cell(dsn_as(cells_dsn, APP_ROLE), "cell_1")) as limiter:
        made = await AdminService(limiter.store).keys.create(None, label="cell 1's own")
    stored = {"Authorization": f"Bearer {made.key}"}
    ceiling = {"models": ["gpt-4o"], "tokens_per_minute": 100_000}
    for method, path, body in (
        ("PUT", "/v1/ceilings/openai", ceiling),
        ("GET", "/v1/tenants", None),
        ("POST", "/v1/admit", {**REQUEST, "tenant": TWO}),
    ):
        answer = await client.request(method, path, json=body, headers=stored)
        assert answer.status_code == 403, answer.text
        assert "LLMQUOTA_ADMIN_KEY" in answer.json()["error"]["message"]
    for k in (1, 2):
        assert (
            await db.fetchval(f"SELECT count(*) FROM cell_{k}.limit_layers WHERE scope = 'ceiling'")
            == 0
        )
        assert await db.fetchval(f"SELECT count(*) FROM cell_{k}.reservations") == 0

    # Revoked in cell 1, it is a key no cell holds once the front's memory of
    # it lapses (the key cache's negative window): 401, as on one database.
    async with await Limiter.connect(in_cell(dsn_as(cells_dsn, APP_ROLE), "cell_1")) as limiter:
        keys = AdminService(limiter.store).keys
        await keys.create(None, label="its successor")  # (the last one is never revoked)
        await keys.revoke(None, made.record.key_id)
    window = front_settings().key_negative_cache_seconds
    deadline = time.monotonic() + window + 5
    while (answer := await client.get("/v1/tenants", headers=stored)).status_code == 403:
        assert time.monotonic() < deadline, f"still 403 {window + 5:.0f} s after the revocation"
        await asyncio.sleep(0.2)
    assert answer.status_code == 401, answer.text


async def test_the_tenant_directory_pages_through_every_cells_tenants_once(
    client: httpx.AsyncClient,
) -> None:
    tenants = IN_CELL[1][:4] + IN_CELL[2][:3]
    await put_tenants(client, tenants)
    seen: list[str] = []
    params: dict[str, str | int] = {"limit": 3}
    for _ in range(10):
        page = await client.get("/v1/tenants", params=params, headers=ADMIN)
        assert page.status_code == 200, page.text
        assert len(page.json()["tenants"]) <= 3
        seen += [t["tenant"] for t in page.json()["tenants"]]
        if page.json()["next_cursor"] is None:
            break
        params["cursor"] = page.json()["next_cursor"]
    assert sorted(seen) == sorted(tenants) and len(seen) == len(tenants)
    bad = await client.get("/v1/tenants", params={"cursor": "cells.e30"}, headers=ADMIN)
    assert bad.status_code == 422, bad.text
    for limit in ("5000", "abc", ""):
        wrong = await client.get("/v1/tenants", params={"limit": limit}, headers=ADMIN)
        assert wrong.status_code == 422, (limit, wrong.text)
    blank_plan = await client.get("/v1/tenants", params={"plan": ""}, headers=ADMIN)
    assert blank_plan.status_code == 422, blank_plan.text  # as one database answers it
    key = (await client.post(f"/v1/tenants/{ONE}/keys", headers=ADMIN)).json()["key"]
    tenant = await client.get("/v1/tenants", headers={"Authorization": f"Bearer {key}"})
    assert tenant.status_code in (401, 403), tenant.text  # the admin's listing


async def test_what_no_cell_answers_alone_is_refused_with_501(client: httpx.AsyncClient) -> None:
    listing = await client.get("/v1/ceilings/openai/oversubscription", headers=ADMIN)
    assert listing.status_code == 501
    assert listing.json()["error"]["type"] == "not_served_over_cells"
    # The front's own answers carry the request's id, as every answer does.
    assert listing.json()["request_id"] == listing.headers["x-request-id"]
    mine = await client.get("/v1/admin/keys", headers={**ADMIN, "x-request-id": "req-mine-1"})
    assert mine.headers["x-request-id"] == "req-mine-1" == mine.json()["request_id"]
    # One id for the front and the cell that answered.
    healthy = await client.get("/v1/plans", headers={**ADMIN, "x-request-id": "req-mine-2"})
    assert healthy.status_code == 200
    assert healthy.headers.get_list("x-request-id") == ["req-mine-2"]
    # An id not fit to keep is replaced, by one id for the front and its cell.
    replaced = await client.get(
        "/v1/tenants/nobody/status", headers={**ADMIN, "x-request-id": "a b"}
    )
    (made,) = replaced.headers.get_list("x-request-id")
    assert made.startswith("req_") and replaced.json()["request_id"] == made
    assert (await client.get("/metrics")).status_code == 501
    one = await client.get("/metrics", params={"cell": "cell_2"})
    assert one.status_code == 200 and "llmquota_" in one.text
    assert (await client.get("/healthz")).json() == {"status": "ok"}


async def test_llmquota_serve_at_the_public_dsn_serves_every_cell(cells_dsn: str) -> None:
    dsn = dsn_as(cells_dsn, APP_ROLE)
    without_key = await asyncio.to_thread(run_cli, "serve", dsn=dsn, check=False)
    assert without_key.returncode == 2
    assert "holds 2 cells: set LLMQUOTA_ADMIN_KEY" in without_key.stderr
    migrating = await asyncio.to_thread(
        run_cli, "serve", "--migrate", dsn=dsn, env={"LLMQUOTA_ADMIN_KEY": ADMIN_KEY}, check=False
    )
    assert migrating.returncode == 2
    assert "`llmquota migrate --cells 2` builds and checks them" in migrating.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMQUOTA_")}
    env.update(LLMQUOTA_DATABASE_URL=dsn)
    port = reserved_port()
    env.update(LLMQUOTA_ADMIN_KEY=ADMIN_KEY, LLMQUOTA_DECISION_DEADLINE_MS="60000")
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "llmquota.cli", "serve", "--port", str(port)),
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        assert process.stdout is not None
        line = await asyncio.wait_for(process.stdout.readline(), 60)
        assert line == b"serving 2 cells: cell_1, cell_2\n"
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
            deadline = time.monotonic() + 60
            while True:
                with contextlib.suppress(httpx.TransportError):
                    if (await c.get("/healthz")).status_code == 200:
                        break
                assert time.monotonic() < deadline, "the service did not start"
                await asyncio.sleep(0.2)
            await put_tenants(c, [ONE, TWO])
            for tenant in (ONE, TWO):
                body = {**REQUEST, "tenant": tenant}
                answer = await c.post("/v1/admit", json=body, headers=ADMIN)
                assert answer.status_code == 201, answer.text
    finally:
        process.send_signal(signal.SIGTERM)
        await asyncio.wait_for(process.wait(), 60)


async def test_each_cell_has_a_maintenance_leader_of_its_own(cells_dsn: str) -> None:
    """The cells of one database share its advisory locks: each cell's
    services take the maintenance lock of their cell, so that every cell is
    swept; a deployment without cells takes the lock's own name, as before."""
    dsn = dsn_as(cells_dsn, APP_ROLE)
    settings = front_settings()
    metrics = Metrics()
    async with contextlib.AsyncExitStack() as stack:
        leaders = []
        # Cell 2's service has its search_path in `options`: its session says its cell.
        options = f"{dsn}{'&' if '?' in dsn else '?'}options=-csearch_path%3Dcell_2"
        for cell_dsn in (in_cell(dsn, "cell_1"), options):
            limiter = await Limiter.connect(cell_dsn, settings)
            stack.push_async_callback(limiter.close)
            running = maintenance_running(limiter.store, settings, metrics, limiter.store.dsn)
            leaders.append(await stack.enter_async_context(running))
        deadline = time.monotonic() + 30
        while not all(leader is not None and leader.leading for leader in leaders):
            assert time.monotonic() < deadline, "not every cell has a leader"
            await asyncio.sleep(0.1)
        public = LeaderLock(dsn)  # the name's own key: free while both cells lead
        try:
            assert await public.try_acquire()
        finally:
            await public.release()


async def test_one_cells_service_watches_no_ceiling_a_plain_deployments_does(
    cells_dsn: str, app_dsn: str
) -> None:
    # A cell holds a slice of each ceiling: its own detector alerted at 90%
    # of its slice. Named by the DSN's search_path or by the session's
    # schema (`options`), it now runs none; a deployment without cells does.
    settings = api_settings().model_copy(update={"ceiling_alerts": True})
    options = f"{cells_dsn}{'&' if '?' in cells_dsn else '?'}options=-csearch_path%3Dcell_2"
    # app_dsn is a plain deployment's, but in CI's in-cell run it names a cell too.
    plain = (app_dsn, cell_named_in(app_dsn) is None)
    for dsn, watched in ((in_cell(cells_dsn, "cell_1"), False), (options, False), plain):
        store = await Store.connect(dsn, min_size=1, max_size=1)
        try:
            alerts = AlertStore(store.pool)
            async with ceiling_alerts_of_the_deployment(store, alerts, settings, dsn) as detector:
                assert (detector is not None) == watched, dsn
        finally:
            await store.close()
