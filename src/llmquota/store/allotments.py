"""Typed access to allotments (sql/allotments.sql): one named statement per call.

Beside store.py, over the same pool. The statements move room between the
layers, a worker's slices and the reservations it admitted; none of them is
read, changed in Python and written back.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, NamedTuple

from llmquota.domain.records import TenantFigures, TokenLayerFigures
from llmquota.store.connection import Row
from llmquota.store.pool import DeadlinePool

GrantStatus = Literal["allotted", "low", "exact", "unknown", "stale"]


class SliceKey(NamedTuple):
    """What a slice is taken for: the layers of a request of this tenant, route
    and API key, and the model (a provider ceiling matching it rules slices out)."""

    tenant: str
    route: str | None
    model: str
    key_id: int | None


@dataclass(frozen=True, slots=True)
class Grant:
    """lq_allot's answer: what was added to the slice, and the layers' room after."""

    status: GrantStatus
    tokens: int
    requests: int
    lease_seconds: int | None
    room_tokens: float | None
    room_requests: float | None
    tenant: TenantFigures
    plan: str | None
    binding: TokenLayerFigures | None
    now: datetime


class SliceAdmission(NamedTuple):
    """One admission decided from a slice, to journal as a reservation (a
    tuple: one is built per admission, and a frozen dataclass costs a call per field)."""

    allotment_id: uuid.UUID
    reservation_id: uuid.UUID
    input_tokens: int
    input_estimated: bool
    max_tokens: int
    reserved_tokens: int
    lease_seconds: int | None
    upstream: str | None  # the deployment it goes to (None: none named)


class AllotmentStore:
    """Take, journal, return and sweep slices."""

    def __init__(self, pool: DeadlinePool, sql: dict[str, str]) -> None:
        self._pool = pool
        self._sql = sql

    async def _fetch(self, name: str, *args: Any, deadline_seconds: float | None) -> list[Row]:
        return await self._pool.fetch(self._sql[name], args, deadline_seconds=deadline_seconds)

    async def allot(
        self,
        allotment_id: uuid.UUID,
        key: SliceKey,
        *,
        tokens: int,
        requests: int,
        share: float,
        min_tokens: int,
        holder: str,
        hold_seconds: int,
        top_up: bool,
        deadline_seconds: float | None = None,
    ) -> Grant:
        """Take or top up a slice (one statement: the layers, then the slice);
        `top_up`: the worker holds it already (a slice gone meanwhile is stale)."""
        row = (
            await self._fetch(
                "allot",
                allotment_id,
                key.tenant,
                key.route,
                key.model,
                key.key_id,
                tokens,
                requests,
                share,
                min_tokens,
                holder,
                hold_seconds,
                top_up,
                deadline_seconds=deadline_seconds,
            )
        )[0]
        return Grant(
            status=row["status"],
            tokens=int(row["granted_tokens"]),
            requests=int(row["granted_requests"]),
            lease_seconds=row["lease_seconds"],
            room_tokens=row["room_tokens"],
            room_requests=row["room_requests"],
            tenant=TenantFigures(
                row["tenant_tokens_per_minute"],
                row["tenant_token_burst"],
                row["tenant_tokens"],
                row["tenant_requests_per_minute"],
                row["tenant_request_burst"],
                row["tenant_requests"],
            ),
            plan=row["plan"],
            binding=None
            if row["binding_tokens_per_minute"] is None
            else TokenLayerFigures(
                row["binding_tokens_per_minute"],
                row["binding_token_burst"],
                row["binding_tokens"],
            ),
            now=row["now_ts"],
        )

    async def journal(
        self,
        admissions: Sequence[SliceAdmission],
        hold_seconds: int,
        *,
        deadline_seconds: float | None = None,
    ) -> dict[uuid.UUID, int]:
        """Write admissions as reservations, moving their room off their slices;
        how many were written per slice (0: the slice is gone, see `orphans`)."""
        rows = await self._fetch(
            "allot_journal",
            *_columns(admissions, with_slice=True),
            hold_seconds,
            deadline_seconds=deadline_seconds,
        )
        return {row["allotment_id"]: int(row["journaled"]) for row in rows}

    async def orphans(
        self,
        key: SliceKey,
        admissions: Sequence[SliceAdmission],
        *,
        deadline_seconds: float | None = None,
    ) -> int:
        """Journal admissions of a slice that is gone, debiting the layers again."""
        rows = await self._fetch(
            "allot_orphans",
            key.tenant,
            key.route,
            key.model,
            key.key_id,
            *_columns(admissions, with_slice=False),
            deadline_seconds=deadline_seconds,
        )
        return int(rows[0]["journaled"])

    async def give_back(
        self, allotment_ids: Sequence[uuid.UUID], *, deadline_seconds: float | None = None
    ) -> tuple[int, int]:
        """Return slices' room to their layers: (slices returned, tokens returned)."""
        rows = await self._fetch(
            "allot_return", list(allotment_ids), deadline_seconds=deadline_seconds
        )
        return int(rows[0]["returned"]), int(rows[0]["tokens"])

    async def sweep(self, limit: int, *, deadline_seconds: float | None = None) -> tuple[int, int]:
        """Return up to `limit` slices past their expiry: (slices, tokens returned)."""
        rows = await self._fetch("allot_sweep", limit, deadline_seconds=deadline_seconds)
        return int(rows[0]["returned"]), int(rows[0]["tokens"])


def _columns(admissions: Sequence[SliceAdmission], *, with_slice: bool) -> list[list[Any]]:
    """The journal's arrays, one per column (the slice's id first when asked)."""
    columns: list[list[Any]] = [
        [a.reservation_id for a in admissions],
        [a.input_tokens for a in admissions],
        [a.input_estimated for a in admissions],
        [a.max_tokens for a in admissions],
        [a.reserved_tokens for a in admissions],
        [a.lease_seconds for a in admissions],
        [a.upstream for a in admissions],
    ]
    if with_slice:
        columns.insert(0, [a.allotment_id for a in admissions])
    return columns
