"""Reservation ids a slice makes (domain/slice_ids.py): version 7, time-ordered, unique."""

from __future__ import annotations

import time
import uuid

from llmquota.domain.outage_ids import is_outage_id
from llmquota.domain.slice_ids import SliceIds, may_be_journaled_later


def test_ids_are_version_7_with_the_rfc_variant_and_the_time_in_milliseconds() -> None:
    ids = SliceIds()
    before = time.time_ns() // 1_000_000
    made = ids.new()
    after = time.time_ns() // 1_000_000
    assert made.version == 7
    assert made.variant == uuid.RFC_4122
    assert before <= made.int >> 80 <= after
    assert may_be_journaled_later(made)
    assert not is_outage_id(made)


def test_ids_are_unique_and_ordered_by_time_across_many_random_blocks() -> None:
    ids = SliceIds()
    made = [ids.new() for _ in range(5_000)]  # about 20 blocks of randomness
    assert len(set(made)) == 5_000
    millis = [i.int >> 80 for i in made]
    assert millis == sorted(millis)
    # 74 random bits each: no two share their random part.
    assert len({i.int & ((1 << 76) - 1) for i in made}) == 5_000


def test_ids_of_other_forms_are_not_a_slices() -> None:
    assert not may_be_journaled_later(uuid.uuid4())  # PostgreSQL's gen_random_uuid()
    assert not may_be_journaled_later(uuid.UUID(int=uuid.uuid4().int & ~(0xF << 76) | 8 << 76))
