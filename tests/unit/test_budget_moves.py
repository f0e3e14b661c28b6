"""domain/budget_moves.py: the moves that spread the global room, and the
free permits in flight, over cells' slices."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmquota.domain.budget_moves import (
    RESERVE,
    SHORTFALL,
    SlicePermits,
    SliceRoom,
    plan_moves,
    plan_permit_moves,
)


def test_before_any_spending_is_known_the_room_follows_the_bursts() -> None:
    # Cell 0 is dry, cell 1 full: half of what they hold goes to cell 0.
    [move] = plan_moves([SliceRoom(0.0, 0.0, 50_000, 50), SliceRoom(50_000.0, 50.0, 50_000, 50)])
    assert (move.giver, move.taker) == (1, 0)
    assert (move.tokens, move.requests) == (25_000.0, 25.0)
    assert (move.keep_tokens, move.keep_requests) == (25_000.0, 25.0)


def test_room_follows_what_each_cell_spent_with_a_reserve_by_burst() -> None:
    # Cell 0 spent everything it had since the last round, cell 1 nothing:
    # of the 50,000 left, cell 1 keeps its half of the reserve, an eighth.
    rooms = [SliceRoom(0.0, None, 50_000, None), SliceRoom(50_000.0, None, 50_000, None)]
    [move] = plan_moves(rooms, [(25_000.0, 0.0), (0.0, 0.0)])
    idle_share = 50_000 * RESERVE / 2
    assert (move.giver, move.taker) == (1, 0)
    assert move.tokens == pytest.approx(50_000 - idle_share)
    assert move.keep_tokens == pytest.approx(idle_share)
    assert move.requests == 0.0


def test_slices_near_their_share_are_left_alone() -> None:
    almost = 25_000 - SHORTFALL * 50_000 * 0.9
    assert (
        plan_moves([SliceRoom(almost, None, 50_000, None), SliceRoom(25_000.0, None, 50_000, None)])
        == []
    )


def test_cells_without_a_global_policy_neither_give_nor_take() -> None:
    rooms = [None, SliceRoom(0.0, None, 10, None), SliceRoom(10.0, None, 10, None)]
    [move] = plan_moves(rooms)
    assert (move.giver, move.taker, move.tokens) == (2, 1, 5.0)


def test_a_slice_in_debt_takes_but_its_debt_is_not_anybody_elses_room() -> None:
    [move] = plan_moves(
        [SliceRoom(-4_000.0, None, 10_000, None), SliceRoom(8_000.0, None, 10_000, None)]
    )
    # 8,000 held in all: each cell's share is 4,000, whatever the debt.
    assert (move.giver, move.taker, move.tokens, move.keep_tokens) == (1, 0, 4_000.0, 4_000.0)


rooms_strategy = st.lists(
    st.one_of(
        st.none(),
        st.builds(
            lambda burst, fill: SliceRoom(burst * fill, None, burst, None),
            st.integers(1, 100_000),
            st.floats(-1.0, 1.0),
        ),
    ),
    min_size=1,
    max_size=8,
)


@given(rooms_strategy, st.data())
def test_moves_never_create_room_nor_take_a_giver_below_its_share(
    rooms: list[SliceRoom | None], data: st.DataObject
) -> None:
    spent = [
        data.draw(st.one_of(st.none(), st.tuples(st.floats(0, 1e5), st.just(0.0)))) for _ in rooms
    ]
    moves = plan_moves(rooms, spent)
    balances = {i: r.tokens for i, r in enumerate(rooms) if r is not None and r.tokens is not None}
    for move in moves:
        assert move.tokens >= 0 and move.giver != move.taker
        balances[move.giver] -= move.tokens
        balances[move.taker] += move.tokens
    for move in moves:
        # what a giver gives leaves it at or above what it keeps
        assert balances[move.giver] >= move.keep_tokens - 1e-6
    for i, room in enumerate(rooms):
        # no taker is sent more than its burst holds (the credit would clamp it away)
        if room is not None and i in {m.taker for m in moves}:
            assert balances[i] <= room.token_burst + 1e-6
    before = sum(r.tokens for r in rooms if r is not None and r.tokens is not None)
    assert sum(balances.values()) == pytest.approx(before, abs=1e-6)


def test_no_slice_is_sent_more_than_its_burst_holds() -> None:
    # A spent everything it had, B is full: A's share by demand would pass
    # its burst; what A cannot hold stays with B instead of being clamped away.
    rooms = [SliceRoom(60.0, None, 100, None), SliceRoom(100.0, None, 100, None)]
    [move] = plan_moves(rooms, [(40.0, 0.0), (0.0, 0.0)])
    assert (move.giver, move.taker, move.tokens, move.keep_tokens) == (1, 0, 40.0, 60.0)
    four = [SliceRoom(50.0, None, 100, None)] + [SliceRoom(100.0, None, 100, None)] * 3
    moves = plan_moves(four, [(50.0, 0.0), (0.0, 0.0), (0.0, 0.0), (0.0, 0.0)])
    assert sum(m.tokens for m in moves) == pytest.approx(50.0)  # just what A can take


# -- permits in flight ---------------------------------------------------------


def test_an_idle_cell_lends_its_free_permits_to_a_busy_one_but_one() -> None:
    # Cell 0 uses its whole slice, cell 1 none: of cell 1's 5 free permits,
    # it keeps its part of the reserve (5 * RESERVE / 2, rounded up).
    [move] = plan_permit_moves([SlicePermits(5, 5, 5), SlicePermits(0, 5, 5)])
    assert (move.giver, move.taker, move.permits, move.keep) == (1, 0, 4, 1)


def test_permits_follow_the_demand_back() -> None:
    # Cell 0 borrowed 4 and is idle now; cell 1 uses the one it kept.
    [move] = plan_permit_moves([SlicePermits(0, 9, 5), SlicePermits(1, 1, 5)])
    assert (move.giver, move.taker, move.permits) == (0, 1, 7)


def test_no_permit_in_use_is_lent_and_a_lone_free_one_stays() -> None:
    assert plan_permit_moves([SlicePermits(9, 9, 5), SlicePermits(0, 1, 5)]) == []
    assert plan_permit_moves([SlicePermits(5, 5, 5), SlicePermits(5, 5, 5)]) == []
    assert plan_permit_moves([SlicePermits(0, 5, 5), None, SlicePermits(0, 5, 5)]) == []


slices_strategy = st.lists(
    st.one_of(
        st.none(),
        # (share, moved, in flight): a cap below zero is a cell whose share
        # was lowered below what it lent; calls in flight may pass any cap
        st.tuples(st.integers(1, 50), st.integers(-60, 40), st.integers(0, 60)).map(
            lambda t: SlicePermits(t[2], t[0] + t[1], t[0])
        ),
    ),
    min_size=1,
    max_size=6,
)


@given(slices_strategy)
def test_permit_moves_lend_only_free_permits_and_make_none(
    slices: list[SlicePermits | None],
) -> None:
    moves = plan_permit_moves(slices)
    lent: dict[int, int] = {}
    for move in moves:
        assert move.permits >= 1 and move.giver != move.taker
        assert slices[move.giver] is not None and slices[move.taker] is not None
        lent[move.giver] = lent.get(move.giver, 0) + move.permits
        lent.setdefault(move.taker, 0)
        lent[move.taker] -= move.permits
    for cell, net in lent.items():
        given_slice = slices[cell]
        assert given_slice is not None
        free = given_slice.max_in_flight - given_slice.in_flight
        if net > 0:
            # never a permit in use, never below what it keeps, never its last
            keep = max(m.keep for m in moves if m.giver == cell)
            assert net <= free - keep
            assert given_slice.max_in_flight - net >= 1
