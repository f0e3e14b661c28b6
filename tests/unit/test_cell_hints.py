"""A cell's reservation ids name it, in bits every form of id keeps random."""

from __future__ import annotations

import os
import uuid

import pytest

from llmquota.api.cells_routing import cells_to_ask
from llmquota.domain.cell_hints import (
    HINTED_CELLS,
    hinted_cell,
    new_reservation_id,
    with_cell_hint,
)
from llmquota.domain.outage_ids import is_signed_outage_id, new_outage_id
from llmquota.domain.slice_ids import SliceIds
from llmquota.store.cells import MAX_CELLS, cell_index_named_in, in_cell

KEY = os.urandom(32)


@pytest.mark.parametrize("cells", [1, 2, 3, 64])
def test_each_form_of_id_names_its_cell_and_keeps_its_version_and_variant(cells: int) -> None:
    for index in {0, cells // 2, cells - 1}:
        slices = SliceIds(index)
        made = {
            4: [new_reservation_id(index) for _ in range(200)],
            7: [slices.new() for _ in range(200)],
            8: [new_outage_id(KEY, index) for _ in range(200)],
        }
        for version, ids in made.items():
            assert {i.version for i in ids} == {version}
            assert {i.variant for i in ids} == {uuid.RFC_4122}
            assert {hinted_cell(i, cells) for i in ids} == {index}
            assert len(set(ids)) == 200
        # An outage id's hint is in its signed head: the signature still holds.
        assert all(is_signed_outage_id(i, KEY) for i in made[8])


def test_the_hint_bits_are_random_where_no_cell_is_named() -> None:
    # Outside cells the six bits stay random: all 64 values occur in 4,000 ids.
    slices = SliceIds()
    for ids in (
        [new_reservation_id(None) for _ in range(4_000)],
        [slices.new() for _ in range(4_000)],
        [new_outage_id(KEY) for _ in range(4_000)],
    ):
        assert {hinted_cell(i, HINTED_CELLS) for i in ids} == set(range(HINTED_CELLS))


def test_a_hint_changes_only_its_six_bits() -> None:
    value = uuid.uuid4().int
    hinted = with_cell_hint(value, 37)
    assert (value ^ hinted) & ~(0x3F << 64) == 0
    assert with_cell_hint(value, None) == value
    with pytest.raises(ValueError, match="0 to 63"):
        with_cell_hint(value, 64)
    assert MAX_CELLS == HINTED_CELLS


def test_a_hint_past_the_last_cell_asks_the_first() -> None:
    assert hinted_cell(uuid.UUID(int=with_cell_hint(uuid.uuid4().int, 5)), 3) == 0


def test_the_front_asks_the_hinted_cell_first_then_the_others_in_order() -> None:
    in_third = new_reservation_id(2)
    assert cells_to_ask(f"/v1/reservations/{in_third}/settle", 4) == [2, 0, 1, 3]
    assert cells_to_ask(f"/v1/reservations/{in_third}/heartbeat", 3) == [2, 0, 1]
    assert cells_to_ask(f"/v1/reservations/{in_third}/release", 2) == [0, 1]  # past the last
    assert cells_to_ask("/v1/reservations/not-a-uuid/settle", 3) == [0, 1, 2]


def test_a_cells_service_learns_its_index_from_its_dsn() -> None:
    base = "postgresql://app@db:5432/llmquota"
    assert cell_index_named_in(in_cell(base, "cell_1")) == 0
    assert cell_index_named_in(in_cell(base, "cell_12")) == 11
    assert cell_index_named_in(base) is None
    assert cell_index_named_in(None) is None
    assert cell_index_named_in(f"{base}?search_path=public") is None
    # Names no build makes give no hint (an index past the hint's six bits
    # would fail every admission).
    assert cell_index_named_in(in_cell(base, "cell_64")) == 63
    assert cell_index_named_in(f"{base}?search_path=cell_0") is None
    assert cell_index_named_in(f"{base}?search_path=cell_65") is None
