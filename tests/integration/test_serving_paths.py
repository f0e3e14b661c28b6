"""How each request was served, in the ledger (issue 23): usage_ledger.serving_path.

The admission journals what it knows (reservations.serving_path: a fallback
admitted, a wait for room first), the settlement writes it to its ledger row
unless the settler names its own (the proxy's second deployment:
tests/proxy/test_proxy_deployments.py), and an expiry writes the journaled
one. A settle that reaches a worker which never admitted the reservation
reads the same from the store: the path, and the model and plan its
metrics are labelled with.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest

from llmquota.admission.limiter import Limiter
from llmquota.config import Settings
from llmquota.domain.plans import Ceiling, Plan
from llmquota.domain.records import AdmitRequest, FinishRequest, OutageAdmissionRecord

from .support import expire_leases

REQUEST = {"tenant": "acme", "model": "gpt-4o", "input_tokens": 0, "max_tokens": 100}


@pytest.fixture
async def other(app_dsn: str, settings: Settings) -> AsyncIterator[Limiter]:
    """A second worker on the same database, which admits nothing itself."""
    worker = await Limiter.connect(app_dsn, settings)
    yield worker
    await worker.close()


async def rows(db: asyncpg.Connection, reservation_id: uuid.UUID) -> list[tuple[str, ...]]:
    """The reservation's ledger rows: (entry_kind, outcome, model, serving_path)."""
    found = await db.fetch(
        """SELECT entry_kind, outcome, model, serving_path FROM usage_ledger
            WHERE reservation_id = $1 ORDER BY entry_id""",
        reservation_id,
    )
    return [tuple(r.values()) for r in found]


async def journaled(db: asyncpg.Connection, reservation_id: uuid.UUID) -> str | None:
    path: str | None = await db.fetchval(
        "SELECT serving_path FROM reservations WHERE reservation_id = $1", reservation_id
    )
    return path


def charged(limiter: Limiter, model: str, plan: str) -> float:
    value = limiter.metrics.registry.get_sample_value(
        "llmquota_charged_tokens_total", {"model": model, "plan": plan}
    )
    return value or 0.0


async def test_a_plain_settle_and_a_plain_expiry_say_primary(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await limiter.store.ensure_tenant("acme")
    settled = await limiter.admit(**REQUEST)
    expired = await limiter.admit(**REQUEST)
    await settled.settle(input_tokens=0, output_tokens=40)
    await expire_leases(db, [expired.reservation_id])
    assert (await limiter.sweep()).expired == 1

    assert await journaled(db, settled.reservation_id) is None  # nothing to journal: primary
    assert await rows(db, settled.reservation_id) == [("usage", "ok", "gpt-4o", "primary")]
    assert await rows(db, expired.reservation_id) == [("usage", "expired", "gpt-4o", "primary")]


async def test_a_fallback_admission_is_served_as_fallback_model_settled_or_expired(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    # 1,000 tokens of gpt-4o (refilling one a minute): a second 600 does not fit.
    ceiling = Ceiling(models=["gpt-4o"], tokens_per_minute=1, token_burst=1_000)
    await limiter.store.catalog.put_ceiling("scarce", ceiling)
    await limiter.store.ensure_tenant("acme")
    wanted = {**REQUEST, "max_tokens": 600, "fallback_models": ["gpt-4o-mini"]}
    primary = await limiter.admit(**wanted)
    settled = await limiter.admit(**wanted)
    expired = await limiter.admit(**wanted)
    assert (primary.model, settled.model, expired.model) == ("gpt-4o", "gpt-4o-mini", "gpt-4o-mini")

    await primary.settle(input_tokens=0, output_tokens=500)
    await settled.settle(input_tokens=0, output_tokens=300)
    await expire_leases(db, [expired.reservation_id])
    assert (await limiter.sweep()).expired == 1

    assert await journaled(db, settled.reservation_id) == "fallback_model"
    assert await rows(db, primary.reservation_id) == [("usage", "ok", "gpt-4o", "primary")]
    assert await rows(db, settled.reservation_id) == [
        ("usage", "ok", "gpt-4o-mini", "fallback_model")
    ]
    assert await rows(db, expired.reservation_id) == [
        ("usage", "expired", "gpt-4o-mini", "fallback_model")
    ]


async def test_a_waited_admission_is_queued_whichever_worker_settles_it(
    limiter: Limiter, other: Limiter, db: asyncpg.Connection
) -> None:
    # 100 tokens a second, a burst of 100: the second request waits about a second.
    await limiter.store.catalog.put_plan("business", Plan(priority="high"))
    own = {"tokens_per_minute": 6_000, "token_burst": 100}
    assert await limiter.store.catalog.put_tenant_policy("acme", "business", own) is not None
    first = await limiter.admit(**REQUEST)
    waited = await limiter.admit(max_wait_ms=10_000, **REQUEST)
    assert await journaled(db, first.reservation_id) is None
    assert await journaled(db, waited.reservation_id) == "queued"

    # Settled by reservation id on a worker that never saw the admission (as a
    # settle over REST may land): the path is the journaled one, and the
    # charged tokens carry the model and plan the store answers, not "unknown".
    settlement = await other.settle(waited.reservation_id, input_tokens=0, output_tokens=30)
    await first.settle(input_tokens=0, output_tokens=20)
    assert settlement.charged_tokens == 30
    assert await rows(db, waited.reservation_id) == [("usage", "ok", "gpt-4o", "queued")]
    assert await rows(db, first.reservation_id) == [("usage", "ok", "gpt-4o", "primary")]
    assert charged(other, "gpt-4o", "business") == 30
    assert charged(other, "unknown", "unknown") == 0
    assert charged(limiter, "gpt-4o", "business") == 20  # its own, from what it admitted

    # Waited, expired, then settled late elsewhere: both rows say queued.
    blocker = await limiter.admit(**REQUEST)  # the bucket's 100 tokens, until it refills
    late = await limiter.admit(max_wait_ms=10_000, **REQUEST)
    await blocker.release()
    await expire_leases(db, [late.reservation_id])
    assert (await limiter.sweep()).expired == 1
    assert (await other.settle(late.reservation_id, input_tokens=0, output_tokens=7)).late
    assert await rows(db, late.reservation_id) == [
        ("usage", "expired", "gpt-4o", "queued"),
        ("late", "late", "gpt-4o", "queued"),
    ]
    assert charged(other, "gpt-4o", "business") == 37


async def test_the_settlers_own_path_wins_over_the_journaled_one(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    await limiter.store.ensure_tenant("acme")
    handed_over = await limiter.admit(**REQUEST)
    await limiter.settle(
        handed_over.reservation_id,
        input_tokens=0,
        output_tokens=10,
        serving_path="second_deployment",
    )
    assert await rows(db, handed_over.reservation_id) == [
        ("usage", "ok", "gpt-4o", "second_deployment")
    ]


async def test_an_outage_replay_is_recorded_as_primary(
    limiter: Limiter, db: asyncpg.Connection
) -> None:
    """A failure mode admits the requested model only: its replayed rows say primary,
    and the replay's answer names the model for the metrics."""
    await limiter.store.ensure_tenant("acme")
    version = await db.fetchval("SELECT policy_version FROM limit_layers WHERE tenant = 'acme'")
    ids = [uuid.uuid4(), uuid.uuid4()]
    request = AdmitRequest("acme", None, "gpt-4o", 10, 90, False, None, None, None)
    records = [OutageAdmissionRecord(i, request, int(version), "open") for i in ids]
    assert await limiter.store.outage.record_admissions(records) == [True, True]
    results = await limiter.store.outage.finish(
        [FinishRequest(ids[0], "settle", None, 10, 50, "ok")], [None]
    )
    assert [(r.status, r.model, r.plan) for r in results] == [("settled", "gpt-4o", None)]
    await expire_leases(db, [ids[1]])
    assert (await limiter.sweep()).expired == 1
    assert await rows(db, ids[0]) == [("usage", "ok", "gpt-4o", "primary")]
    assert await rows(db, ids[1]) == [("usage", "expired", "gpt-4o", "primary")]
