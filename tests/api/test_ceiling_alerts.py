"""Provider ceilings alert once per threshold and episode, through the real API and a real receiver.

The app is the real one (its delivery loop POSTs to tests/receiver.py on a
loopback socket, signed); the utilization is driven by real admissions and
releases through /v1/admit. The detector is the one every worker runs
(llmquota.admin.ceiling_alerts), called here one round at a time so each
step is a known sample; the app's own background detector is off for these
tests (tests/faults/test_ceiling_alert_workers.py runs it in real worker
processes). Refill is one token a minute: the utilization is what the test
made it.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime
from typing import Any

import asyncpg
import httpx
import pytest
from fastapi import FastAPI

from llmquota.admin.ceiling_alerts import CeilingAlertDetector
from llmquota.api.app import create_app
from llmquota.config import Settings
from llmquota.domain.ceiling_alerts import AlertDefaults
from llmquota.store.alerts import AlertStore
from llmquota.store.store import Store
from tests.api.conftest import ADMIN_KEY
from tests.receiver import Receiver

SECRET = "whsec_ceiling_0123456789"
SLOW = 1  # tokens per minute: refill is negligible during a test
BURST = 10_000
CEILING = "org-4o"


@pytest.fixture
async def app(app_dsn: str) -> AsyncIterator[FastAPI]:
    """The real app, its delivery loop quick, its own ceiling detector off."""
    settings = Settings(  # type: ignore[call-arg]
        admin_key=ADMIN_KEY,
        pool_min_size=1,
        pool_max_size=10,
        decision_deadline_ms=60_000,
        ceiling_alerts=False,
        alert_delivery_interval_seconds=0.05,
        # The receiver listens on loopback: an on-premise receiver.
        webhook_allowed_networks="127.0.0.0/8",
        _env_file=None,
    )
    made = create_app(settings, dsn=app_dsn)
    async with made.router.lifespan_context(made):
        yield made


@pytest.fixture
async def api(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://llmquota") as c:
        yield c


@pytest.fixture
def admin() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    started = await Receiver().start()
    yield started
    await started.stop()


def detector_of(app: FastAPI, **defaults: float) -> CeilingAlertDetector:
    """A detector over the app's pool, as the app's lifespan would start it."""
    store = app.state.limiter.store
    return CeilingAlertDetector(store.catalog, AlertStore(store.pool), AlertDefaults(**defaults))


async def put(client: httpx.AsyncClient, admin: dict[str, str], path: str, body: Any) -> Any:
    response = await client.put(path, json=body, headers=admin)
    assert response.status_code == 200, response.text
    return response.json()


async def setup(
    api: httpx.AsyncClient, admin: dict[str, str], receiver: Receiver, **ceiling: Any
) -> dict[str, str]:
    """A 10,000-token ceiling on gpt-4o (with `ceiling`'s fields), a critical tenant
    that no ladder sheds, and a webhook to the receiver: the tenant's headers."""
    body = {"models": ["gpt-4o"], "tokens_per_minute": SLOW, "token_burst": BURST, **ceiling}
    await put(api, admin, f"/v1/ceilings/{CEILING}", body)
    await put(api, admin, "/v1/plans/enterprise", {"priority": "critical"})
    await put(api, admin, "/v1/tenants/ent-co/policy", {"plan": "enterprise"})
    key = await api.post("/v1/tenants/ent-co/keys", headers=admin)
    assert key.status_code == 201, key.text
    hook = await api.put(
        "/v1/webhooks/ops", json={"url": receiver.url, "secret": SECRET}, headers=admin
    )
    assert hook.status_code in (200, 201), hook.text
    return {"Authorization": f"Bearer {key.json()['key']}"}


async def take(api: httpx.AsyncClient, tenant: dict[str, str], tokens: int) -> str:
    """Reserve `tokens` of the ceiling; the reservation id."""
    response = await api.post(
        "/v1/admit",
        json={"tenant": "ent-co", "model": "gpt-4o", "input_tokens": 0, "max_tokens": tokens},
        headers=tenant,
    )
    assert response.status_code == 201, response.text
    return str(response.json()["reservation_id"])


async def give_back(api: httpx.AsyncClient, tenant: dict[str, str], reservation: str) -> None:
    response = await api.post(f"/v1/reservations/{reservation}/release", headers=tenant)
    assert response.status_code == 200, response.text


async def utilization(api: httpx.AsyncClient, admin: dict[str, str]) -> float:
    got = await api.get(f"/v1/ceilings/{CEILING}", headers=admin)
    return float(got.json()["utilization"])


async def wait_for(check: Callable[[], Awaitable[bool]], seconds: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + seconds
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def delivered(receiver: Receiver, n: int, db: asyncpg.Connection) -> list[dict[str, Any]]:
    """Wait until the receiver has `n` events (and the outbox nothing undelivered);
    the bodies, in the order they arrived."""

    async def arrived() -> bool:
        pending = await db.fetchval(
            "SELECT count(*) FROM alert_deliveries WHERE delivered_at IS NULL"
        )
        return len(set(receiver.delivered_ids())) >= n and pending == 0

    await wait_for(arrived)
    return [r.json() for r in receiver.delivered()]


async def test_crossing_80_then_95_alerts_once_each_and_staying_or_dipping_briefly_does_not_refire(
    app: FastAPI,
    api: httpx.AsyncClient,
    admin: dict[str, str],
    receiver: Receiver,
    db: asyncpg.Connection,
) -> None:
    # No alert_at: the ladder's steps, 0.8 and 0.95, alert (the defaults:
    # hysteresis 0.05, a minute of quiet).
    ladder = [{"above": 0.8, "admit": ["critical"]}, {"above": 0.95, "admit": ["critical"]}]
    tenant = await setup(api, admin, receiver, shed=ladder)
    shown = await api.get(f"/v1/ceilings/{CEILING}", headers=admin)
    assert shown.json()["alert_at"] is None
    assert shown.json()["alert_thresholds"] == [0.8, 0.95]
    detector = detector_of(app)

    await take(api, tenant, 7_000)
    assert await detector.run_once() == []  # 70%: below both

    small = await take(api, tenant, 1_500)  # 85%: past 0.8
    opened = await detector.run_once()
    assert [(s.dimension, str(s.threshold)) for s, _ in opened] == [("tokens", "0.8")]
    [event] = await delivered(receiver, 1, db)
    assert event["type"] == "ceiling.utilization"
    assert event["ceiling"] == CEILING
    assert event["dimension"] == event["unit"] == "tokens"
    assert event["threshold"] == "0.8"
    assert float(event["utilization"]) == pytest.approx(0.85, abs=0.001)
    assert (event["usage"], event["limit"]) == ("8500", str(BURST))
    assert event["tenant"] is None
    assert event["episode_start"] == event["window_start"]
    assert event["window_end"] is None
    assert datetime.fromisoformat(event["episode_start"]).tzinfo is not None
    assert receiver.all_signed(SECRET)

    # Staying above: no second alert, however many rounds.
    for _ in range(3):
        assert await detector.run_once() == []
    # A dip below 0.8 but not below 0.75 (the hysteresis), and back: the same episode.
    await give_back(api, tenant, small)
    medium = await take(api, tenant, 900)  # 79%
    assert await detector.run_once() == []
    again = await take(api, tenant, 600)  # 85%
    assert await detector.run_once() == []
    # A dip below 0.75, shorter than the quiet time, and back: still the same episode.
    await give_back(api, tenant, medium)
    await give_back(api, tenant, again)  # 70%
    assert await utilization(api, admin) == pytest.approx(0.7, abs=0.001)
    assert await detector.run_once() == []
    await take(api, tenant, 1_500)  # 85%
    assert await detector.run_once() == []

    await take(api, tenant, 1_100)  # 96%: past 0.95
    opened = await detector.run_once()
    assert [(s.dimension, str(s.threshold)) for s, _ in opened] == [("tokens", "0.95")]
    assert await detector.run_once() == []
    events = await delivered(receiver, 2, db)
    assert [e["threshold"] for e in events] == ["0.8", "0.95"]
    assert float(events[1]["utilization"]) == pytest.approx(0.96, abs=0.001)
    # Each event exactly once at the receiver, and once in the outbox.
    assert collections.Counter(receiver.delivered_ids()).most_common(1)[0][1] == 1
    rows = await db.fetch(
        "SELECT subject, threshold FROM alert_outbox WHERE event_type = 'ceiling.utilization'"
        " ORDER BY threshold"
    )
    assert [(r["subject"], str(r["threshold"])) for r in rows] == [
        (f"ceiling:{CEILING}:tokens", "0.8"),
        (f"ceiling:{CEILING}:tokens", "0.95"),
    ]
    assert receiver.all_signed(SECRET)


async def test_below_threshold_minus_hysteresis_for_the_quiet_time_ends_the_episode(
    app: FastAPI,
    api: httpx.AsyncClient,
    admin: dict[str, str],
    receiver: Receiver,
    db: asyncpg.Connection,
) -> None:
    # The ceiling's own hysteresis and quiet time win over the defaults.
    tenant = await setup(
        api, admin, receiver, alert_at=[0.8], alert_hysteresis=0.05, alert_quiet_seconds=0.5
    )
    detector = detector_of(app, hysteresis=0.3, quiet_seconds=3_600.0)
    base = await take(api, tenant, 7_000)
    top = await take(api, tenant, 1_500)  # 85%
    [(first, _)] = await detector.run_once()
    await delivered(receiver, 1, db)

    # Below 0.8 but above 0.75 for longer than the quiet time: not the end.
    await give_back(api, tenant, top)
    extra = await take(api, tenant, 700)  # 77%
    assert await detector.run_once() == []
    await asyncio.sleep(0.6)
    assert await detector.run_once() == []
    back = await take(api, tenant, 800)  # 85%
    assert await detector.run_once() == []

    # Below 0.75 for the quiet time: the episode ends ...
    await give_back(api, tenant, back)
    await give_back(api, tenant, extra)  # 70%
    assert await detector.run_once() == []
    await asyncio.sleep(0.6)
    assert await detector.run_once() == []
    state = await db.fetchrow(
        "SELECT episode_start, last_ended_at FROM ceiling_alert_episodes"
        " WHERE ceiling = $1 AND dimension = 'tokens'",
        CEILING,
    )
    assert state is not None
    assert state["episode_start"] is None and state["last_ended_at"] is not None
    # ... and crossing again is a new episode, with an alert of its own.
    await take(api, tenant, 1_500)  # 85%
    [(second, _)] = await detector.run_once()
    assert second.sampled_at > first.sampled_at
    assert await detector.run_once() == []
    events = await delivered(receiver, 2, db)
    assert [e["threshold"] for e in events] == ["0.8", "0.8"]
    assert len({e["id"] for e in events}) == 2
    assert events[0]["episode_start"] < events[1]["episode_start"]
    assert events[1]["episode_start"] > state["last_ended_at"].isoformat()
    assert receiver.all_signed(SECRET)
    await give_back(api, tenant, base)


async def test_the_request_bucket_alerts_as_requests(
    app: FastAPI,
    api: httpx.AsyncClient,
    admin: dict[str, str],
    receiver: Receiver,
    db: asyncpg.Connection,
) -> None:
    tenant = await setup(
        api, admin, receiver, requests_per_minute=SLOW, request_burst=10, alert_at=[0.5]
    )
    detector = detector_of(app)
    for _ in range(6):  # 6 of 10 requests, 600 of 10,000 tokens
        await take(api, tenant, 100)
    opened = await detector.run_once()
    assert [(s.dimension, str(s.threshold)) for s, _ in opened] == [("requests", "0.5")]
    [event] = await delivered(receiver, 1, db)
    assert (event["dimension"], event["usage"], event["limit"]) == ("requests", "6", "10")
    assert float(event["utilization"]) == pytest.approx(0.6, abs=0.001)


async def test_two_detectors_racing_on_one_database_record_each_crossing_once(  # noqa: PLR0917 (fixtures)
    app: FastAPI,
    api: httpx.AsyncClient,
    admin: dict[str, str],
    receiver: Receiver,
    db: asyncpg.Connection,
    app_dsn: str,
) -> None:
    tenant = await setup(api, admin, receiver, alert_at=[0.5, 0.8, 0.95])
    # Two more workers: each its own pool, as another process would have.
    stores = [await Store.connect(app_dsn, min_size=1, max_size=2) for _ in range(2)]
    try:
        detectors = [detector_of(app)] + [
            CeilingAlertDetector(store.catalog, AlertStore(store.pool)) for store in stores
        ]
        opened: list[Any] = []
        for tokens in (3_000, 3_000, 2_000, 1_600):  # 30, 60, 80, 96%
            await take(api, tenant, tokens)
            rounds = await asyncio.gather(*(d.run_once() for d in detectors for _ in range(4)))
            opened.extend(event for found in rounds for event in found)
    finally:
        for store in stores:
            await store.close()
    assert sorted(str(s.threshold) for s, _ in opened) == ["0.5", "0.8", "0.95"]
    events = await delivered(receiver, 3, db)
    assert sorted(e["threshold"] for e in events) == ["0.5", "0.8", "0.95"]
    assert len(receiver.delivered_ids()) == 3


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"alert_at": [0, 0.5]}, "greater than 0"),
        ({"alert_at": [0.5, 1.2]}, "less than or equal to 1"),
        ({"alert_at": [-0.1]}, "greater than 0"),
        ({"alert_at": [0.95, 0.8]}, "increasing order"),
        ({"alert_at": [0.8, 0.8]}, "increasing order"),
        ({"alert_at": ["0.8"]}, "alert_at"),
        ({"alert_at": [True]}, "alert_at"),
        ({"alert_at": 0.8}, "alert_at"),
        ({"alert_at": [0.01 * n for n in range(1, 22)]}, "at most 20"),
        ({"alert_hysteresis": 0.6}, "alert_hysteresis"),
        ({"alert_hysteresis": -0.01}, "alert_hysteresis"),
        ({"alert_quiet_seconds": -1}, "alert_quiet_seconds"),
        ({"alert_quiet_seconds": 86_401}, "alert_quiet_seconds"),
    ],
)
async def test_a_bad_alert_setting_is_a_422_that_changes_nothing(
    api: httpx.AsyncClient,
    admin: dict[str, str],
    db: asyncpg.Connection,
    fields: dict[str, Any],
    words: str,
) -> None:
    path = f"/v1/ceilings/{CEILING}"
    good = {"models": ["gpt-4o"], "tokens_per_minute": SLOW, "token_burst": BURST}
    before = await put(api, admin, path, {**good, "alert_at": [0.5]})
    row_before = await db.fetchrow("SELECT * FROM limit_layers WHERE ceiling = $1", CEILING)

    refused = await api.put(path, json={**good, **fields}, headers=admin)
    assert refused.status_code == 422, refused.text
    assert words in refused.json()["error"]["message"]
    patched = await api.patch(path, json=fields, headers=admin)
    assert patched.status_code == 422, patched.text
    assert words in patched.json()["error"]["message"]

    after = (await api.get(path, headers=admin)).json()
    assert after == before
    assert await db.fetchrow("SELECT * FROM limit_layers WHERE ceiling = $1", CEILING) == row_before
    assert await db.fetchval("SELECT count(*) FROM ceiling_alert_episodes") == 0


async def test_alert_settings_are_stored_patched_and_reset_to_the_ladder(
    api: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    path = f"/v1/ceilings/{CEILING}"
    ladder = [{"above": 0.9, "admit": ["critical"]}]
    body = {"models": ["gpt-4o"], "tokens_per_minute": SLOW, "token_burst": BURST, "shed": ladder}
    shown = await put(api, admin, path, {**body, "alert_at": [0.5, 0.75], "alert_quiet_seconds": 5})
    assert (shown["alert_at"], shown["alert_thresholds"]) == ([0.5, 0.75], [0.5, 0.75])
    assert (shown["alert_hysteresis"], shown["alert_quiet_seconds"]) == (None, 5.0)
    patched = await api.patch(path, json={"alert_hysteresis": 0.1}, headers=admin)
    assert patched.status_code == 200, patched.text
    assert patched.json()["alert_hysteresis"] == 0.1
    assert patched.json()["alert_at"] == [0.5, 0.75]
    assert patched.json()["policy_version"] > shown["policy_version"]
    # null: back to each step of the ladder; []: no alert at all.
    reset = await api.patch(path, json={"alert_at": None}, headers=admin)
    assert (reset.json()["alert_at"], reset.json()["alert_thresholds"]) == (None, [0.9])
    silent = await api.patch(path, json={"alert_at": []}, headers=admin)
    assert (silent.json()["alert_at"], silent.json()["alert_thresholds"]) == ([], [])


async def test_the_apps_own_detector_alerts_in_the_background(
    app_dsn: str, admin: dict[str, str], receiver: Receiver, db: asyncpg.Connection
) -> None:
    # `serve`'s lifespan runs the detector (the defaults but a quicker round).
    settings = Settings(  # type: ignore[call-arg]
        admin_key=ADMIN_KEY,
        decision_deadline_ms=60_000,
        ceiling_alert_interval_seconds=0.05,
        alert_delivery_interval_seconds=0.05,
        webhook_allowed_networks="127.0.0.0/8",
        _env_file=None,
    )
    made = create_app(settings, dsn=app_dsn)
    async with made.router.lifespan_context(made):
        transport = httpx.ASGITransport(app=made)
        async with httpx.AsyncClient(transport=transport, base_url="http://llmquota") as client:
            tenant = await setup(client, admin, receiver, alert_at=[0.8])
            await take(client, tenant, 9_000)
            [event] = await delivered(receiver, 1, db)
            await asyncio.sleep(0.3)  # several more rounds: nothing more
    assert (event["ceiling"], event["threshold"]) == (CEILING, "0.8")
    assert len(receiver.delivered_ids()) == 1
    assert await db.fetchval("SELECT count(*) FROM alert_outbox") == 1
