"""Which cells' slices of a shared limit should give room to which, and how much.

A database of cells splits each shared limit (the global layer, a provider
ceiling) into K slices (domain/cells.py), so a cell whose tenants are busy
runs dry while an idle cell's slice sits full: near the limit a request is
refused with room left elsewhere.
The rebalancer (admission/rebalancer.py) reads every slice's room and moves
budget so that each slice holds its share of what all of them hold,
dimension by dimension (tokens, requests):

    share_k = RESERVE * burst_k / sum(burst)
              + (1 - RESERVE) * spent_k / sum(spent)

where spent_k is what cell k used since the last round. Room follows demand,
and every cell keeps a reserve in proportion to its burst for demand that
starts between two rounds. With one cell busy and one idle, the idle cell
keeps an eighth of what is left after each round: the busy one can use 7/8
after one round, 63/64 after two. Before the first round (nothing spent
known) the shares follow the bursts.

A share is never above its slice's burst (what a full slice cannot hold
goes to the others): a move never sends more than the taker can hold, which
its credit would clamp away. A slice above its share gives down to it,
never below (the giver's `keep`, rechecked by the debit itself, since
admissions go on meanwhile); a slice short of it by more than SHORTFALL of
its burst takes. Moves only spread
what the slices hold: the planner never adds room, and the debit and credit
in the database never create it (sql/global_layer.sql).

Permits in flight (`max_in_flight`) move by the same rule, in whole permits:
what is spread is the slices' free permits (cap less those in use), a
reserve by each slice's share of the policy and the rest by the permits
each cell has in use now (a permit is held for a call's length, so what is
in use is the demand). A slice gives free permits only, down to its fair
part, and keeps at least one permit (`plan_permit_moves`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

__all__ = [
    "RESERVE",
    "SHORTFALL",
    "Move",
    "PermitMove",
    "SlicePermits",
    "SliceRoom",
    "plan_moves",
    "plan_permit_moves",
]

# The part of the room shared by burst whatever the demand: a reserve for
# tenants that start asking between two rounds.
RESERVE = 0.25
# A slice short of its fair share by less than this fraction of its burst is
# left alone: moving a sliver every round costs two transactions for nothing.
SHORTFALL = 0.05


class SliceRoom(NamedTuple):
    """One cell's global slice now: refilled balances and bursts (None: no such limit)."""

    tokens: float | None
    requests: float | None
    token_burst: int | None
    request_burst: int | None


class Move(NamedTuple):
    """Room for `taker` from `giver` (indexes into the rooms), and what the giver keeps."""

    giver: int
    taker: int
    tokens: float
    requests: float
    keep_tokens: float
    keep_requests: float


def _capped(total: float, weights: dict[int, float], bursts: dict[int, float]) -> dict[int, float]:
    """`total` shared by `weights`, no share above its burst: what a full
    slice cannot hold goes to the others by their weights (the total is at
    most the bursts' sum, so it always fits)."""
    shares: dict[int, float] = {}
    open_cells = dict(weights)
    left = total
    while open_cells:
        weight = sum(open_cells.values())
        offer = {
            cell: left * (w / weight if weight > 0 else 1 / len(open_cells))
            for cell, w in open_cells.items()
        }
        full = [cell for cell, share in offer.items() if share >= bursts[cell]]
        if not full:
            shares.update(offer)
            break
        for cell in full:
            shares[cell] = bursts[cell]
            left -= bursts[cell]
            del open_cells[cell]
    return shares


def _flows(
    entries: list[tuple[int, float, int, float | None]],
) -> tuple[dict[tuple[int, int], float], dict[int, float]]:
    """For one dimension, each cell's (index, balance, burst, spent since the
    last round or None): what each (giver, taker) pair moves, and the shares."""
    total = sum(max(balance, 0.0) for _, balance, _, _ in entries)
    bursts = sum(burst for _, _, burst, _ in entries)
    spent = sum(used or 0.0 for _, _, _, used in entries)
    if bursts <= 0:
        return {}, {}
    weights = {
        cell: burst / bursts
        if spent <= 0
        else RESERVE * burst / bursts + (1 - RESERVE) * (used or 0.0) / spent
        for cell, _, burst, used in entries
    }
    fair = _capped(total, weights, {cell: float(burst) for cell, _, burst, _ in entries})
    givers = sorted(
        ((balance - fair[cell], cell) for cell, balance, _, _ in entries if balance > fair[cell]),
        reverse=True,
    )
    takers = sorted(
        (
            (fair[cell] - balance, cell)
            for cell, balance, burst, _ in entries
            if fair[cell] - balance > SHORTFALL * burst
        ),
        reverse=True,
    )  # (a share is at most the burst, so no taker is sent more than it can hold)
    flows: dict[tuple[int, int], float] = {}
    g = t = 0
    surplus = [amount for amount, _ in givers]
    deficit = [amount for amount, _ in takers]
    while g < len(givers) and t < len(takers):
        amount = min(surplus[g], deficit[t])
        pair = (givers[g][1], takers[t][1])
        flows[pair] = flows.get(pair, 0.0) + amount
        surplus[g] -= amount
        deficit[t] -= amount
        if surplus[g] <= 1e-9:
            g += 1
        if deficit[t] <= 1e-9:
            t += 1
    return flows, fair


def plan_moves(
    rooms: Sequence[SliceRoom | None], spent: Sequence[tuple[float, float] | None] | None = None
) -> list[Move]:
    """The moves that bring every slice to its share. `spent`: per cell, the
    tokens and requests it used since the last round (None: not known). Cells
    without a global policy (None) neither give nor take."""
    used = list(spent) if spent is not None else [None] * len(rooms)
    spent_tokens = [None if u is None else u[0] for u in used]
    spent_requests = [None if u is None else u[1] for u in used]
    tokens, fair_tokens = _flows(
        [
            (cell, room.tokens, room.token_burst, spent_tokens[cell])
            for cell, room in enumerate(rooms)
            if room is not None and room.tokens is not None and room.token_burst
        ]
    )
    requests, fair_requests = _flows(
        [
            (cell, room.requests, room.request_burst, spent_requests[cell])
            for cell, room in enumerate(rooms)
            if room is not None and room.requests is not None and room.request_burst
        ]
    )
    return [
        Move(
            giver,
            taker,
            tokens.get((giver, taker), 0.0),
            requests.get((giver, taker), 0.0),
            fair_tokens.get(giver, 0.0),
            fair_requests.get(giver, 0.0),
        )
        for giver, taker in sorted(tokens.keys() | requests.keys())
    ]


class SlicePermits(NamedTuple):
    """One cell's slice of a shared layer's permits now."""

    in_flight: int
    max_in_flight: int  # its cap, moves included
    share: int  # the policy's share of it (the cap less what moves brought)


class PermitMove(NamedTuple):
    """Permits for `taker` from `giver` (indexes into the slices), and the free
    permits the giver keeps."""

    giver: int
    taker: int
    permits: int
    keep: int


def plan_permit_moves(slices: Sequence[SlicePermits | None]) -> list[PermitMove]:
    """The moves that bring every slice's free permits to its fair part of
    all of them. Cells without the layer (None) neither give nor take."""
    cells = [(cell, s) for cell, s in enumerate(slices) if s is not None]
    shares = sum(s.share for _, s in cells)
    in_use = sum(s.in_flight for _, s in cells)
    free = {cell: s.max_in_flight - s.in_flight for cell, s in cells}
    total = sum(max(0, f) for f in free.values())
    if shares <= 0 or total <= 0:
        return []
    fair = {
        cell: total
        * (
            RESERVE * s.share / shares + (1 - RESERVE) * s.in_flight / in_use
            if in_use > 0
            else s.share / shares
        )
        for cell, s in cells
    }
    givers = sorted(
        ((math.floor(free[c] - fair[c]), c) for c, _ in cells if free[c] - fair[c] >= 1),
        reverse=True,
    )
    takers = sorted(
        (
            (math.floor(fair[c] - free[c]), c)
            for c, s in cells
            if fair[c] - free[c] >= max(1.0, SHORTFALL * s.share)
        ),
        reverse=True,
    )
    moves: list[PermitMove] = []
    surplus = [amount for amount, _ in givers]
    deficit = [amount for amount, _ in takers]
    g = t = 0
    while g < len(givers) and t < len(takers):
        amount = min(surplus[g], deficit[t])
        giver, taker = givers[g][1], takers[t][1]
        moves.append(PermitMove(giver, taker, amount, math.ceil(fair[giver])))
        surplus[g] -= amount
        deficit[t] -= amount
        g += surplus[g] == 0
        t += deficit[t] == 0
    return moves
