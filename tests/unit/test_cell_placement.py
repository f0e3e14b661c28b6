"""domain/cells.py: where a tenant lives among K cells, and each cell's slice of a shared limit."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmquota.domain.cells import cell_of, slice_of
from llmquota.domain.errors import InvalidRequest
from llmquota.domain.policy import Policy


def test_a_tenant_is_placed_by_a_fixed_hash_of_its_name() -> None:
    # CRC-32 of the UTF-8 name: the same in every process and Python version
    # (Python's own hash() of a str is salted per process).
    assert [cell_of("acme", k) for k in (1, 2, 3, 7, 64)] == [1, 1, 3, 7, 63]
    assert cell_of("tenant-07", 2) == cell_of("tenant-07", 2)
    placed = subprocess.run(
        [
            sys.executable,
            "-c",
            "from llmquota.domain.cells import cell_of; print(cell_of('ünï', 5))",
        ],
        check=True,
        capture_output=True,
        text=True,
        env={"PYTHONHASHSEED": "random"},
    )
    assert int(placed.stdout) == cell_of("ünï", 5)


@given(total=st.integers(min_value=64, max_value=10**10), cells=st.integers(1, 64))
def test_the_slices_sum_to_the_total_and_differ_by_at_most_one(total: int, cells: int) -> None:
    policy = Policy(tokens_per_minute=total, token_burst=total, requests_per_minute=cells)
    slices = [slice_of(policy, cell, cells) for cell in range(1, cells + 1)]
    for field in ("tokens_per_minute", "token_burst", "requests_per_minute", "request_burst"):
        parts = [getattr(s, field) for s in slices]
        assert sum(parts) == getattr(policy.resolved(), field)
        assert max(parts) - min(parts) <= 1


def test_an_unset_limit_stays_unset_and_the_rest_of_the_policy_is_kept() -> None:
    part = slice_of(Policy(tokens_per_minute=10, lease_seconds=45, failure_mode="open"), 2, 3)
    assert (part.tokens_per_minute, part.token_burst, part.requests_per_minute) == (3, 3, None)
    assert (part.lease_seconds, part.failure_mode, part.max_in_flight) == (45, "open", None)


def test_a_limit_smaller_than_the_cell_count_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="max_in_flight, tokens_per_minute must be at least"):
        slice_of(Policy(tokens_per_minute=2, token_burst=100, max_in_flight=1), 1, 3)
