"""The model-based conservation test (issue 20, "Proof").

A seeded random walk over several prepaid tenants with daily quotas, a
provider ceiling and a sharded global layer, against the real PostgreSQL
(harness.py drives it, model.py says what every figure must be). After
every step: per-layer conservation of tokens, in-flight counts, the holds of
every open reservation, ledger = settled usage (per reservation, exactly
once), each credit balance = its model and its ledger, each quota window =
its charges and open holds, and lq_audit() clean. At its export steps and at
the end, the billing export read from its cursor has given every ledger row
once, as the ledger holds it, under ids without a gap.

CI runs one walk of LLMQUOTA_MODEL_STEPS (2,000) steps with seed
LLMQUOTA_MODEL_SEED (20) over the step kinds in ENABLED;
LLMQUOTA_MODEL_WALKS=N runs N walks, seeds SEED to SEED + N - 1, each on a
fresh database (lq_audit() recomputes the whole journal after every step,
so a step costs more the longer one walk runs: ten walks of 10,000 check
100,000 steps in a fraction of the time of one walk of 100,000). Every
kind is on: outages and the kill of the replaying worker, absurd
settlements, shard changes and statements that outlive their deadline
included. A long run:

    LLMQUOTA_MODEL_STEPS=10000 LLMQUOTA_MODEL_WALKS=10 LLMQUOTA_MODEL_SEED=7 \
        .venv/bin/pytest -q -s -p no:cacheprovider tests/model

LLMQUOTA_MODEL_KINDS overrides the enabled kinds: `all`, a comma list of
names, or `+name,...` for ENABLED and those (e.g. `+outage` to try a fix).
"""

from __future__ import annotations

import os
import uuid

import pytest

from tests.conftest import _admin, dsn_with_database
from tests.model.harness import ALL_KINDS, Outcome, walk

ENABLED = frozenset(ALL_KINDS)

DEFAULT_STEPS = 2_000
DEFAULT_SEED = 20
# Generous per-step allowance for a loaded 2-core machine (a step takes ~50 ms).
SECONDS_PER_STEP = 0.5


def _kinds() -> frozenset[str]:
    chosen = os.environ.get("LLMQUOTA_MODEL_KINDS", "")
    if not chosen:
        return ENABLED
    if chosen == "all":
        return frozenset(ALL_KINDS)
    names = [k.strip() for k in chosen.split(",") if k.strip()]
    if all(name.startswith("+") for name in names):
        return ENABLED | {name[1:] for name in names}
    return frozenset(names)


STEPS = int(os.environ.get("LLMQUOTA_MODEL_STEPS", DEFAULT_STEPS))
SEED = int(os.environ.get("LLMQUOTA_MODEL_SEED", DEFAULT_SEED))
WALKS = int(os.environ.get("LLMQUOTA_MODEL_WALKS", "1"))


async def _walk_on_a_fresh_database(
    server_dsn: str, template: str, seed: int, kinds: frozenset[str]
) -> Outcome:
    name = f"llmquota_model_{seed}_{uuid.uuid4().hex[:8]}"
    await _admin(server_dsn, f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    try:
        return await walk(dsn_with_database(server_dsn, name), seed, STEPS, kinds)
    finally:
        await _admin(server_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.mark.slow
@pytest.mark.timeout(60 + WALKS * STEPS * SECONDS_PER_STEP)
async def test_books_balance_after_every_step_of_a_random_walk(
    server_dsn: str, template_database: str
) -> None:
    kinds = _kinds()
    for seed in range(SEED, SEED + WALKS):
        outcome = await _walk_on_a_fresh_database(server_dsn, template_database, seed, kinds)
        tally = outcome.tally
        print(
            f"FIGURE model: seed {outcome.seed}, {outcome.steps} steps in "
            f"{outcome.seconds:.1f} s, kinds {sorted(kinds)}: {dict(sorted(tally.items()))}",
            flush=True,
        )
        assert sum(v for k, v in tally.items() if k.startswith("step ")) == STEPS
        # Each enabled kind ran, and the walk did real work.
        for kind in kinds:
            assert tally[f"step {kind}"] > 0, kind
        if "admit" in kinds:
            assert tally["admit admitted"] > STEPS // 10
        if "settle" in kinds:
            assert tally["settle settled"] > 0 and tally["settle replayed"] > 0
        if "expire" in kinds and "settle" in kinds:
            assert tally["settle late"] > 0
