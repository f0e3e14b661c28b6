"""Fixtures of the tests only a Citus coordinator can run (marker citus_only)."""

from __future__ import annotations

import pytest

from tests.citus.nodes import CitusNodes


@pytest.fixture
def cluster(citus_nodes: CitusNodes | None) -> CitusNodes:
    """The cluster the test server coordinates; a failure, never a skip, without one."""
    if citus_nodes is None:
        pytest.fail(
            "this test needs a Citus coordinator: run it under .ci/with-citus "
            "(pytest -m citus_only), which builds Citus and starts one"
        )
    return citus_nodes
