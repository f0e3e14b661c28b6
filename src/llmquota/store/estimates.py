"""The learned output histograms: the statement that reads them.

Settlement writes them in lq_finish's own transaction (sql/estimates.sql);
workers read them from here into their cache (admission/estimates.py), and
`llmquota estimates` prints them.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from llmquota.domain.output_estimates import OutputHistogram, StoredHistogram
from llmquota.store.pool import DeadlinePool


@dataclass(frozen=True, slots=True)
class HistogramRead:
    """The histograms a read found, and the database clock when it ran."""

    read_at: datetime
    histograms: list[StoredHistogram]


class EstimateStore:
    """Typed access to the output histograms."""

    def __init__(self, pool: DeadlinePool, sql: dict[str, str]) -> None:
        self._pool = pool
        self._sql = sql

    async def histograms(
        self,
        *,
        changed_after: datetime | None = None,
        tenant: str | None = None,
        model: str | None = None,
        limit: int,
        deadline_seconds: float | None = None,
    ) -> HistogramRead:
        """Histograms changed after `changed_after` (None: all), optionally of one tenant, model."""
        rows = await self._pool.fetch(
            self._sql["output_histograms"],
            (changed_after, tenant, model, limit),
            deadline_seconds=deadline_seconds,
        )
        found = [
            StoredHistogram(
                tenant=row["tenant"],
                route=row["route"] or None,
                model=row["model"],
                histogram=OutputHistogram(
                    weights=tuple(row["weights"]),
                    samples=int(row["samples"]),
                    updated_at=float(row["updated_epoch"]),
                ),
            )
            for row in rows
            if row["tenant"] is not None
        ]
        return HistogramRead(read_at=rows[0]["read_at"], histograms=found)
