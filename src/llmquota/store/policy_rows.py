"""Layer rows to policies, and the policy snapshot's layers kept from one load to the next.

A worker loads every layer's policy again whenever any of them changes
(admission/recovery.py: the snapshot has one version for all). With 10,000
tenants that was 10,000 pydantic `Policy` objects built on the event loop,
75-97 ms of CPU during which no request of that worker was answered, and as
many new long-lived objects for the garbage collector's full collections to
walk (admission/heap.py). Most layers are the same as at the last load: a
layer whose row is the same, column for column, gets the same `CachedLayer`
back, so a change of one policy builds one.
"""

from __future__ import annotations

from collections.abc import Sequence

from llmquota.domain.output_estimates import parse_output_estimate
from llmquota.domain.policy import Policy
from llmquota.domain.records import CachedLayer
from llmquota.domain.response_cache import parse_cache_policy
from llmquota.store.connection import Row

# The policy_snapshot columns a CachedLayer is made of (sql/queries.sql): from
# `scope` on, `fallback_models` (an array, so not hashable as it comes) last.
_FIRST_LAYER_COLUMN = 2

LayerRowKey = tuple[tuple[object, ...], tuple[str, ...]]


def policy_from_row(row: Row) -> Policy:
    """A layer's policy from the columns every policy query names alike."""
    return Policy(
        tokens_per_minute=row["tokens_per_minute"],
        token_burst=row["token_burst"],
        requests_per_minute=row["requests_per_minute"],
        request_burst=row["request_burst"],
        max_in_flight=row["max_in_flight"],
        lease_seconds=row["lease_seconds"],
        failure_mode=row["failure_mode"],
        output_estimate=parse_output_estimate(row.get("output_estimate")),
        request_cost=row.get("request_cost"),
        uses_concurrency=row.get("uses_concurrency"),
        cache=parse_cache_policy(row.get("cache")),
        admission=row.get("admission"),
    )


class SnapshotLayers:
    """The layers of the last policy snapshot, by their rows' content."""

    def __init__(self) -> None:
        self._by_row: dict[LayerRowKey, CachedLayer] = {}

    def layers(self, rows: Sequence[Row]) -> list[CachedLayer]:
        """A CachedLayer per row: the last snapshot's where the row is the same."""
        last, self._by_row = self._by_row, {}
        layers = []
        if rows:
            columns = list(rows[0].keys())
            if columns[_FIRST_LAYER_COLUMN] != "scope" or columns[-1] != "fallback_models":
                raise RuntimeError(f"policy_snapshot's columns are not as expected: {columns}")
        for row in rows:
            # A slice of the record: 0.1 us a row where naming 16 columns took 1.3.
            fallback_models = tuple(row[-1] or ())
            key = (row[_FIRST_LAYER_COLUMN:-1], fallback_models)
            layer = last.get(key)
            if layer is None:
                layer = CachedLayer(
                    scope=row["scope"],
                    tenant=row["tenant"],
                    route=row["route"],
                    policy=policy_from_row(row),
                    policy_version=int(row["policy_version"]),
                    fallback_models=fallback_models,
                )
            self._by_row[key] = layer
            layers.append(layer)
        return layers
