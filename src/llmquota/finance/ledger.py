"""The ledger's finance side: adjustments, model prices and the billing export.

The ledger itself is written by the admission functions (a settlement or an
expiry appends its row in the same transaction); this module is what finance
and billing pipelines do with it afterwards. Each method runs one named
statement of sql/finance_queries.sql over one connection, never the
admission pool: nothing here can make an admission wait.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, date, datetime, time
from decimal import Decimal, InvalidOperation
from typing import Any, Literal

from llmquota.domain.errors import InvalidRequest, UnknownTenant
from llmquota.domain.validation import check_model, check_name
from llmquota.store.connection import Connection, Row, translate_errors
from llmquota.store.sqlfiles import named_queries

TokenType = Literal["input", "output"]
TOKEN_TYPES: tuple[TokenType, ...] = ("input", "output")

# One adjustment moves at most this many tokens either way (a month of a large
# tenant's corrections fits; a typo with extra zeros does not).
MAX_ADJUSTMENT_TOKENS = 1_000_000_000_000
MAX_REASON_CHARS = 1_000
# Prices are numeric(14, 6) in the database: refuse what it would round.
PRICE_DECIMAL_PLACES = 6
MAX_PRICE_USD_PER_MILLION = Decimal(1_000_000)
MAX_EXPORT_PAGE_ROWS = 10_000

_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    """One exported ledger row with its gapless export id."""

    export_id: int
    entry_id: int
    recorded_at: datetime
    entry_kind: str
    tenant: str
    route: str | None
    model: str | None
    reservation_id: uuid.UUID | None
    input_tokens: int
    output_tokens: int
    reserved_tokens: int
    outcome: str
    policy_version: int | None
    reason: str | None

    def to_json(self) -> dict[str, Any]:
        """The JSON line a billing pipeline reads; `id` is the export cursor."""
        return {
            "id": self.export_id,
            "entry_id": self.entry_id,
            "recorded_at": self.recorded_at.isoformat(),
            "entry_kind": self.entry_kind,
            "tenant": self.tenant,
            "route": self.route,
            "model": self.model,
            "reservation_id": str(self.reservation_id) if self.reservation_id else None,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "reserved_tokens": self.reserved_tokens,
            "outcome": self.outcome,
            "policy_version": self.policy_version,
            "reason": self.reason,
        }


@dataclass(frozen=True, slots=True)
class Adjustment:
    """An appended correction row."""

    entry_id: int
    recorded_at: datetime
    tenant: str
    route: str | None
    model: str | None
    input_tokens: int
    output_tokens: int
    reason: str

    def to_json(self) -> dict[str, Any]:
        """As printed by `llmquota ledger adjust`."""
        return {
            "entry_id": self.entry_id,
            "recorded_at": self.recorded_at.isoformat(),
            "entry_kind": "adjustment",
            "tenant": self.tenant,
            "route": self.route,
            "model": self.model,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "reason": self.reason,
        }


@dataclass(frozen=True, slots=True)
class ModelPrice:
    """A model's prices per million tokens from effective_from on."""

    model: str
    effective_from: datetime
    input_usd_per_million: Decimal
    output_usd_per_million: Decimal


def check_adjustment_tokens(tokens: object) -> int:
    """A signed, non-zero token count within MAX_ADJUSTMENT_TOKENS."""
    if isinstance(tokens, bool) or not isinstance(tokens, int):
        raise InvalidRequest("tokens must be an integer")
    if tokens == 0 or abs(tokens) > MAX_ADJUSTMENT_TOKENS:
        raise InvalidRequest(
            f"tokens must be non-zero and between -{MAX_ADJUSTMENT_TOKENS} and "
            f"{MAX_ADJUSTMENT_TOKENS}"
        )
    return tokens


def check_reason(reason: object) -> str:
    """The reason of an adjustment: required, 1 to MAX_REASON_CHARS characters."""
    if not isinstance(reason, str) or not reason.strip():
        raise InvalidRequest("a reason is required for an adjustment")
    if len(reason) > MAX_REASON_CHARS:
        raise InvalidRequest(f"reason must be at most {MAX_REASON_CHARS} characters")
    return reason


def parse_price(name: str, text: str) -> Decimal:
    """A price per million tokens: a plain decimal, 0 or more, at most 6 places."""
    try:
        value = Decimal(text.strip())
    except (InvalidOperation, AttributeError):
        raise InvalidRequest(
            f"{name} must be a decimal number such as 2.50, not {text!r}"
        ) from None
    if not value.is_finite() or value < 0 or value > MAX_PRICE_USD_PER_MILLION:
        raise InvalidRequest(f"{name} must be between 0 and {MAX_PRICE_USD_PER_MILLION}")
    exponent = value.as_tuple().exponent
    if isinstance(exponent, int) and exponent < -PRICE_DECIMAL_PLACES:
        raise InvalidRequest(f"{name} has more than {PRICE_DECIMAL_PLACES} decimal places")
    return value


def parse_effective_from(text: str) -> datetime:
    """YYYY-MM-DD (midnight UTC) or an ISO 8601 time with a UTC offset."""
    try:
        if _DATE.match(text):
            return datetime.combine(date.fromisoformat(text), time(), tzinfo=UTC)
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise InvalidRequest(
            f"effective-from must be a date (YYYY-MM-DD) or an ISO time, not {text!r}"
        ) from None
    if moment.tzinfo is None:
        raise InvalidRequest("effective-from as a time must carry a UTC offset, e.g. +00:00")
    return moment


class LedgerStore:
    """The finance statements over one connection."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self._sql = named_queries("finance_queries.sql")

    async def _fetch(self, name: str, *args: Any) -> list[Row]:
        with translate_errors():
            rows: list[Row] = await self._connection.fetch(self._sql[name], *args)
        return rows

    async def adjust(
        self,
        *,
        tenant: str,
        tokens: int,
        reason: str,
        model: str | None = None,
        route: str | None = None,
        token_type: TokenType = "output",
    ) -> Adjustment:
        """Append a signed correction of `tokens` (input or output) for a tenant."""
        check_name("tenant", tenant)
        if route is not None:
            check_name("route", route)
        if model is not None:
            check_model(model)
        check_adjustment_tokens(tokens)
        check_reason(reason)
        if token_type not in TOKEN_TYPES:
            raise InvalidRequest(f"token type must be one of {', '.join(TOKEN_TYPES)}")
        input_tokens, output_tokens = (tokens, 0) if token_type == "input" else (0, tokens)
        rows = await self._fetch(
            "adjust_ledger", tenant, route, model, input_tokens, output_tokens, reason
        )
        if not rows:
            raise UnknownTenant(f"unknown tenant {tenant!r}")
        row = rows[0]
        return Adjustment(
            entry_id=int(row["entry_id"]),
            recorded_at=row["recorded_at"],
            tenant=row["tenant"],
            route=row["route"],
            model=row["model"],
            input_tokens=int(row["input_tokens"]),
            output_tokens=int(row["output_tokens"]),
            reason=row["reason"],
        )

    async def export_page(
        self, after_export_id: int, limit: int, number_limit: int
    ) -> list[LedgerEntry]:
        """Up to `limit` rows after the cursor, numbering newly final rows first."""
        if after_export_id < 0:
            raise InvalidRequest("after-id must be 0 or more")
        if not 1 <= limit <= MAX_EXPORT_PAGE_ROWS:
            raise InvalidRequest(f"a page holds 1 to {MAX_EXPORT_PAGE_ROWS} rows")
        # Numbering fewer rows than a page would end a stream early.
        numbered = max(number_limit, limit)
        rows = await self._fetch("export_ledger", after_export_id, limit, numbered)
        return [LedgerEntry(**dict(row)) for row in rows]

    async def export(
        self,
        after_export_id: int,
        *,
        limit: int | None,
        page_rows: int,
        number_limit: int,
    ) -> AsyncIterator[LedgerEntry]:
        """Stream rows after the cursor until caught up, or `limit` rows.

        Each page is its own short transaction: a consumer killed between
        pages loses nothing, and resumes after the last id it processed.
        """
        remaining = limit
        cursor = after_export_id
        while remaining is None or remaining > 0:
            size = page_rows if remaining is None else min(page_rows, remaining)
            page = await self.export_page(cursor, size, number_limit)
            for entry in page:
                yield entry
            if len(page) < size:
                return  # caught up with every row that is final now
            cursor = page[-1].export_id
            if remaining is not None:
                remaining -= len(page)

    async def set_price(
        self,
        *,
        model: str,
        input_usd_per_million: Decimal,
        output_usd_per_million: Decimal,
        effective_from: datetime | None = None,
    ) -> tuple[ModelPrice, bool]:
        """Set a model's prices from `effective_from` (None: now); (price, replaced)."""
        check_model(model)
        rows = await self._fetch(
            "set_price", model, effective_from, input_usd_per_million, output_usd_per_million
        )
        row = rows[0]
        return _price(row), bool(row["replaced"])

    async def prices(self, model: str | None = None) -> list[ModelPrice]:
        """Every price (or one model's), oldest first."""
        return [_price(row) for row in await self._fetch("list_prices", model)]


def _price(row: Row) -> ModelPrice:
    return ModelPrice(
        model=row["model"],
        effective_from=row["effective_from"],
        input_usd_per_million=row["input_usd_per_million"],
        output_usd_per_million=row["output_usd_per_million"],
    )
