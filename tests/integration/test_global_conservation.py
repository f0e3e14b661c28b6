"""Changing the global layer's shard count conserves tokens: a random walk.

A seeded walk of admits, settlements (some above the reservation, some
late), releases, expiries and shard-count changes runs against the real
PostgreSQL, and after every step checks that no token was created or
destroyed: the pooled balance refilled to now plus the tokens held by open
reservations equals the burst minus everything settled so far.

Refill is made irrelevant by its rate: 4 tokens a minute for the whole layer
(the least a 4-shard split allows), so it can add at most 4/60 of a token per
second of the walk, which the check allows on the upper side only; one lost
or doubled give-back is hundreds of tokens. The settlements stay within
lq_shared_charge_cap and their total within the burst, so neither the cap
nor the floor at minus the burst (lq_credit_layers) comes into it: the
arithmetic is plain sums.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import asyncpg
import pytest

from llmquota.admission.limiter import Limiter, Reservation
from llmquota.domain.errors import RateLimited
from llmquota.domain.policy import Policy

from .support import put

BURST = 40_000
TOKENS_PER_MINUTE = 4  # the whole layer's: at most 1/15 of a token a second
MAX_SHARDS = 4
STEPS = 300
TENANTS = [f"walker{i}" for i in range(6)]


@dataclass
class Open:
    reservation: Reservation
    input_tokens: int
    max_tokens: int


def _cap(input_tokens: int, max_tokens: int) -> int:
    """lq_shared_charge_cap, as documented."""
    return math.ceil(input_tokens * 1.25) + 64 + max_tokens


async def _put_global(limiter: Limiter, shards: int) -> None:
    policy = Policy(tokens_per_minute=TOKENS_PER_MINUTE, token_burst=BURST)
    await limiter.store.put_policy("global", None, None, policy, shards=shards)


async def _books(db: asyncpg.Connection) -> tuple[float, int, int, float]:
    """(pooled balance refilled to now + tokens held open, permits on the global
    rows, open reservations, the database clock as epoch seconds)."""
    row = await db.fetchrow(
        """SELECT (SELECT tokens FROM global_layer) AS balance,
                  (SELECT coalesce(sum(reserved_tokens), 0) FROM reservations
                    WHERE state = 'active') AS held,
                  (SELECT sum(in_flight) FROM limit_layers WHERE scope = 'global') AS permits,
                  (SELECT count(*) FROM reservations WHERE state = 'active') AS open,
                  extract(epoch FROM clock_timestamp()) AS at"""
    )
    assert row is not None
    return (
        float(row["balance"]) + float(row["held"]),
        int(row["permits"]),
        int(row["open"]),
        float(row["at"]),
    )


class Walk:
    """The walk's state and its arithmetic: what must be in the books."""

    def __init__(self, limiter: Limiter, db: asyncpg.Connection, seed: int) -> None:
        self.limiter, self.db, self.rng = limiter, db, random.Random(seed)
        self.shards = MAX_SHARDS
        self.settled_total = 0  # what left the layer for good, by the arithmetic
        self.active: list[Open] = []
        self.expired: list[Open] = []
        self.done = {"admit": 0, "refused": 0, "settle": 0, "late": 0, "release": 0, "expire": 0}
        self.reshards_with_open = 0

    def _charge(self, held: Open) -> int:
        """A usage within the cap, mostly below the reservation, whose running
        total stays within the burst (so the floor is never reached)."""
        room = BURST - 2_000 - self.settled_total
        most = _cap(held.input_tokens, held.max_tokens)
        wanted = self.rng.randint(
            0, most if self.rng.random() < 0.2 else held.reservation.reserved_tokens
        )
        return max(0, min(wanted, room))

    def _take(self, pool: list[Open]) -> Open:
        return pool.pop(self.rng.randrange(len(pool)))

    async def admit(self) -> None:
        input_tokens, max_tokens = self.rng.randint(200, 4_000), self.rng.randint(0, 1_000)
        try:
            held = await self.limiter.admit(
                tenant=self.rng.choice(TENANTS),
                model="gpt-4o",
                input_tokens=input_tokens,
                max_tokens=max_tokens,
            )
        except RateLimited as refused:
            assert (refused.limit, refused.scope) == ("tokens", "global")
            self.done["refused"] += 1
        else:
            self.active.append(Open(held, input_tokens, max_tokens))
            self.done["admit"] += 1

    async def settle(self) -> None:
        held = self._take(self.active)
        used = self._charge(held)
        output = self.rng.randint(0, used)
        await held.reservation.settle(input_tokens=used - output, output_tokens=output)
        self.settled_total += used
        self.done["settle"] += 1

    async def late(self) -> None:
        held = self._take(self.expired)
        used = self._charge(held)
        settlement = await held.reservation.settle(input_tokens=used, output_tokens=0)
        assert settlement.late
        self.settled_total += used
        self.done["late"] += 1

    async def release(self) -> None:
        await self._take(self.active).reservation.release()
        self.done["release"] += 1

    async def expire(self) -> None:
        held = self._take(self.active)
        await self.db.execute(
            "UPDATE reservations SET lease_expires_at = clock_timestamp() - interval '1 s' "
            "WHERE reservation_id = $1",
            held.reservation.reservation_id,
        )
        assert await self.limiter.store.sweep(10) == (1, held.reservation.reserved_tokens)
        self.expired.append(held)
        self.done["expire"] += 1

    async def reshard(self) -> None:
        self.shards = self.rng.choice([k for k in range(1, MAX_SHARDS + 1) if k != self.shards])
        await _put_global(self.limiter, self.shards)
        self.reshards_with_open += bool(self.active or self.expired)

    async def step(self) -> str:
        """One random move (a finish with nothing to finish does nothing)."""
        move = self.rng.choices(
            ["admit", "settle", "late", "release", "expire", "reshard"],
            weights=[40, 14, 6, 12, 8, 12],
        )[0]
        pool = self.expired if move == "late" else self.active
        if move in ("admit", "reshard") or pool:
            await getattr(self, move)()
        return move


@pytest.mark.parametrize("seed", [20, 2026])
async def test_a_random_walk_with_shard_changes_neither_creates_nor_destroys_tokens(
    limiter: Limiter, db: asyncpg.Connection, seed: int
) -> None:
    walk = Walk(limiter, db, seed)
    await _put_global(limiter, walk.shards)
    for tenant in TENANTS:
        await put(limiter, "tenant", tenant)
    _, _, _, started_at = await _books(db)

    for step in range(STEPS):
        move = await walk.step()
        books, permits, open_count, at = await _books(db)
        expected = BURST - walk.settled_total
        refill_allowance = TOKENS_PER_MINUTE / 60 * (at - started_at)
        assert expected - 1e-6 <= books <= expected + refill_allowance + 1e-6, (
            f"step {step} ({move}, {walk.shards} shards): {books} tokens in the books, "
            f"{expected} by the arithmetic"
        )
        assert open_count == permits == len(walk.active)

    # The walk did what it is for: shard changes under open reservations, and
    # every way of finishing one, some of them after a change.
    assert walk.reshards_with_open >= 20
    assert min(walk.done.values()) >= 5, walk.done
    assert await limiter.store.audit() == []
