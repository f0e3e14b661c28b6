"""The statements of outage recovery: recording a worker's journal, and the
budgets a worker keeps for deciding `local` admissions while the store is away.

Recording (sql/reliability.sql): lq_record_outage_admissions writes the
journaled admissions once each, held on every layer, quota and prepaid
balance they belong to; lq_finish_outage settles or releases them at the
journal's moment, through lq_finish. The budgets (the `outage_budgets`
query) are read with every policy refresh (admission/recovery.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from datetime import datetime
from decimal import Decimal
from typing import Any

from llmquota.domain.ladder import LadderStep
from llmquota.domain.local_budget import (
    CeilingFigures,
    ModelPrice,
    OutageBudgets,
    QuotaFigures,
)
from llmquota.domain.policy import Policy
from llmquota.domain.records import FinishRequest, FinishResult, OutageAdmissionRecord
from llmquota.store.connection import Row
from llmquota.store.decisions import finish_results
from llmquota.store.pool import DeadlinePool


class OutageStore:
    """Typed access to the outage statements."""

    def __init__(self, pool: DeadlinePool, sql: dict[str, str]) -> None:
        self._pool = pool
        self._sql = sql

    async def _fetch(
        self, name: str, *args: Any, deadline_seconds: float | None = None
    ) -> list[Row]:
        return await self._pool.fetch(self._sql[name], args, deadline_seconds=deadline_seconds)

    async def record_admissions(
        self, records: Sequence[OutageAdmissionRecord], *, deadline_seconds: float | None = None
    ) -> list[bool]:
        """Record outage admissions once each; True where this call wrote the row."""
        rows = await self._fetch(
            "record_outage_admissions",
            [r.reservation_id for r in records],
            [r.request.tenant for r in records],
            [r.request.route for r in records],
            [r.request.model for r in records],
            [r.request.input_tokens for r in records],
            [r.request.max_tokens for r in records],
            [r.request.input_estimated for r in records],
            [r.request.lease_seconds for r in records],
            [r.request.idempotency_key for r in records],
            [r.request.request_hash for r in records],
            [r.policy_version for r in records],
            [r.mode for r in records],
            [r.admitted_at for r in records],
            [r.request.key_id for r in records],
            deadline_seconds=deadline_seconds,
        )
        return [bool(row["recorded"]) for row in rows]

    async def finish(
        self,
        requests: Sequence[FinishRequest],
        used_at: Sequence[datetime | None],
        *,
        deadline_seconds: float | None = None,
    ) -> list[FinishResult]:
        """Settle or release reservations recorded from an outage journal, their
        usage counted at the journaled moment `used_at` (None: now)."""
        rows = await self._fetch(
            "finish_outage",
            [r.reservation_id for r in requests],
            [r.action for r in requests],
            [r.caller for r in requests],
            [r.input_tokens for r in requests],
            [r.output_tokens for r in requests],
            [r.outcome for r in requests],
            list(used_at),
            deadline_seconds=deadline_seconds,
        )
        return finish_results(rows)

    async def budgets(
        self, max_rows: int, *, deadline_seconds: float | None = None
    ) -> OutageBudgets:
        """The ceilings, blocking quotas, prepaid balances and prices as they are now."""
        rows = await self._fetch("outage_budgets", max_rows, deadline_seconds=deadline_seconds)
        credits: dict[str, Decimal] = {}
        prices: dict[str, ModelPrice] = {}
        for row in rows:
            if row["kind"] == "credits":
                credits[row["tenant"]] = row["available"]
            elif row["kind"] == "price":
                prices[row["name"]] = ModelPrice(row["price_in"], row["price_out"])
        return OutageBudgets(
            ceilings=tuple(_ceiling(row) for row in rows if row["kind"] == "ceiling"),
            quotas=tuple(_quota(row) for row in rows if row["kind"] == "quota"),
            credits=credits,
            prices=prices,
        )


def _ceiling(row: Row) -> CeilingFigures:
    return CeilingFigures(
        ceiling=row["name"],
        model_patterns=tuple(row["patterns"]),
        policy=Policy(
            tokens_per_minute=row["tokens_per_minute"],
            token_burst=row["token_burst"],
            requests_per_minute=row["requests_per_minute"],
            request_burst=row["request_burst"],
            max_in_flight=row["max_in_flight"],
        ),
        policy_version=int(row["policy_version"]),
        ladder=tuple(_ladder(row["ladder"])),
        upstream=row["upstream"],
    )


def _ladder(text: str | None) -> Iterator[LadderStep]:
    """A ceiling's queueing ladder as outage_budgets sends it (jsonb arrays), if any."""
    for above, admit, small, queue_ms in json.loads(text) if text is not None else ():
        yield LadderStep(float(above), int(admit), small, queue_ms)


def _quota(row: Row) -> QuotaFigures:
    return QuotaFigures(
        quota_id=int(row["quota_id"]),
        name=row["name"],
        tenant=row["tenant"],
        route=row["route"],
        model_patterns=tuple(row["patterns"]),
        tokens=row["tokens_limit"],
        cost=row["cost_limit"],
        used_tokens=int(row["used_tokens"]),
        used_cost=row["used_cost"],
        window_end=row["window_end"],
    )
