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
from llmquota.domain.validation import check_model, check_model_glob, check_name
from llmquota.store.connection import Connection, Row, translate_errors
from llmquota.store.sqlfiles import named_queries

TokenType = Literal["input", "output"]
TOKEN_TYPES: tuple[TokenType, ...] = ("input", "output")

# One adjustment moves at most this many tokens either way: a billion tokens,
# days of a large tenant's traffic, is more than one correction of a real
# mistake needs; 10^12 (the old bound) hid a year of anyone's usage in one
# row. lq_ledger_adjust enforces the same figure, and refuses taking back
# more than the tenant recorded lately.
MAX_ADJUSTMENT_TOKENS = 1_000_000_000
MAX_REASON_CHARS = 1_000
MAX_SET_BY_CHARS = 200
# Prices are numeric(14, 6) in the database: refuse what it would round.
PRICE_DECIMAL_PLACES = 6
MAX_PRICE_USD_PER_MILLION = Decimal(1_000_000)
MAX_EXPORT_PAGE_ROWS = 10_000
# No price takes effect before this (lq_set_price's bound too): asyncpg sends
# 0001-01-01 as -infinity, which priced all of history.
MIN_EFFECTIVE_FROM = datetime(2000, 1, 1, tzinfo=UTC)

# ASCII digits only: `\d` and Decimal() also take other scripts' digits
# (Arabic-Indic, fullwidth), and Decimal() takes `_` separators and
# surrounding space.
_DATE = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")
_PRICE = re.compile(r"[0-9]+(\.[0-9]+)?")
# What an ISO time may hold: digits, separators, a fraction and an offset.
_ISO_TIME = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}[T ][0-9:.]+(Z|[+-][0-9]{2}:?[0-9]{2})?")


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
    # Where the figures came from (reported | clamped | counted; None on an
    # expiry, an adjustment, and rows older than revision 0016), and an
    # upstream's own figures where they differ from the settled ones.
    usage_source: str | None = None
    reported_input_tokens: int | None = None
    reported_output_tokens: int | None = None
    # How the request was served (primary, cache, fallback_model, queued,
    # second_deployment; None on adjustments and rows older than revision
    # 0026); a cache hit's tokens the provider would have billed; a price the
    # row carries beside its tokens' (a cache hit's, when the policy sets one),
    # as a decimal string, so no float ever holds money.
    serving_path: str | None = None
    saved_input_tokens: int | None = None
    saved_output_tokens: int | None = None
    price_usd: Decimal | None = None

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
            "usage_source": self.usage_source,
            "reported_input_tokens": self.reported_input_tokens,
            "reported_output_tokens": self.reported_output_tokens,
            "serving_path": self.serving_path,
            "saved_input_tokens": self.saved_input_tokens,
            "saved_output_tokens": self.saved_output_tokens,
            "price_usd": None if self.price_usd is None else str(self.price_usd),
        }


def _whole(value: Decimal | None) -> int | None:
    """A numeric(…, 0) figure as the integer it is (a provider's can exceed bigint)."""
    return None if value is None else int(value)


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
    """One version of a model's prices per million tokens from effective_from on.

    `model` is a name or a `*` glob. Versions are never changed: set_at, who
    set it, and why it took effect before it was set (backdate_reason).
    """

    model: str
    effective_from: datetime
    input_usd_per_million: Decimal
    output_usd_per_million: Decimal
    set_at: datetime
    set_by: str
    backdate_reason: str | None


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


def check_set_by(set_by: object) -> str:
    """Who sets a price version: 1 to MAX_SET_BY_CHARS characters."""
    if not isinstance(set_by, str) or not set_by.strip():
        raise InvalidRequest("a price version needs who set it (--set-by)")
    if len(set_by) > MAX_SET_BY_CHARS:
        raise InvalidRequest(f"set-by must be at most {MAX_SET_BY_CHARS} characters")
    return set_by


def parse_price(name: str, text: str) -> Decimal:
    """A price per million tokens: ASCII digits with an optional fraction
    (`2.50`), 0 or more, at most 6 places; no sign, space or `_`."""
    if not isinstance(text, str) or not _PRICE.fullmatch(text):
        raise InvalidRequest(f"{name} must be a decimal number such as 2.50, not {text!r}")
    try:
        value = Decimal(text)
    except InvalidOperation:
        raise InvalidRequest(
            f"{name} must be a decimal number such as 2.50, not {text!r}"
        ) from None
    if value > MAX_PRICE_USD_PER_MILLION:
        raise InvalidRequest(f"{name} must be between 0 and {MAX_PRICE_USD_PER_MILLION}")
    exponent = value.as_tuple().exponent
    if isinstance(exponent, int) and exponent < -PRICE_DECIMAL_PLACES:
        raise InvalidRequest(f"{name} has more than {PRICE_DECIMAL_PLACES} decimal places")
    return value


def parse_effective_from(text: str) -> datetime:
    """YYYY-MM-DD (midnight UTC) or an ISO 8601 time with a UTC offset, in
    ASCII digits; empty is an error, not "now" (leave the flag out for now)."""
    if not text:
        raise InvalidRequest("effective-from is empty: give a date, or leave it out for now")
    try:
        if _DATE.fullmatch(text):
            return check_effective_from(
                datetime.combine(date.fromisoformat(text), time(), tzinfo=UTC)
            )
        if not _ISO_TIME.fullmatch(text):
            raise ValueError(text)
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise InvalidRequest(
            f"effective-from must be a date (YYYY-MM-DD) or an ISO time, not {text!r}"
        ) from None
    if moment.tzinfo is None:
        raise InvalidRequest("effective-from as a time must carry a UTC offset, e.g. +00:00")
    return check_effective_from(moment)


def check_effective_from(moment: datetime) -> datetime:
    """A price's start: from MIN_EFFECTIVE_FROM on (the far end is the database's)."""
    if moment < MIN_EFFECTIVE_FROM:
        raise InvalidRequest(
            f"effective-from must be {MIN_EFFECTIVE_FROM.date().isoformat()} or later"
        )
    return moment


class LedgerStore:
    """The finance statements over one connection."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self._sql = named_queries("finance_queries.sql")

    async def _fetch(self, name: str, *args: Any) -> list[Row]:
        # The finance functions' own refusals (a backdate without a reason, a
        # correction beyond the bound) reach the operator with their reasons.
        with translate_errors(own_refusals=True):
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
        entries = []
        for row in rows:
            fields = dict(row)
            for name in ("reported_input_tokens", "reported_output_tokens"):
                fields[name] = _whole(fields[name])
            entries.append(LedgerEntry(**fields))
        return entries

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
        set_by: str,
        effective_from: datetime | None = None,
        backdate_reason: str | None = None,
    ) -> tuple[ModelPrice, bool]:
        """Add a version of a model's (or a `*` glob's) prices from
        `effective_from` (None: now); (version, superseded).

        A version taking effect in the past needs `backdate_reason`, and never
        reaches into a closed month (lq_set_price decides, by the database
        clock).
        """
        check_model_glob(model, "model")  # an exact name or a `*` glob, as quotas take
        check_set_by(set_by)
        if effective_from is not None:
            check_effective_from(effective_from)
        if backdate_reason is not None:
            check_reason(backdate_reason)
        rows = await self._fetch(
            "set_price",
            model,
            effective_from,
            input_usd_per_million,
            output_usd_per_million,
            set_by,
            backdate_reason,
        )
        row = rows[0]
        return _price(row), bool(row["superseded"])

    async def import_builtin_prices(
        self, rows: list[tuple[str, datetime, Decimal, Decimal]]
    ) -> list[tuple[str, datetime, datetime, str]]:
        """Import (model, in force from, input, output) rows of the shipped table in
        one statement; per row (model, declared from, effective from, outcome),
        outcome one of added, unchanged, operator, superseded (sql/ledger.sql)."""
        result = await self._fetch(
            "import_builtin_prices",
            [r[0] for r in rows],
            [r[1] for r in rows],
            [r[2] for r in rows],
            [r[3] for r in rows],
        )
        return [(r["model"], r["declared_from"], r["effective_from"], r["outcome"]) for r in result]

    async def prices(self, model: str | None = None) -> list[ModelPrice]:
        """Every price version (or one model's), oldest first."""
        if model is not None:
            check_model_glob(model, "model")
        return [_price(row) for row in await self._fetch("list_prices", model)]


def _price(row: Row) -> ModelPrice:
    return ModelPrice(
        model=row["model"],
        effective_from=row["effective_from"],
        input_usd_per_million=row["input_usd_per_million"],
        output_usd_per_million=row["output_usd_per_million"],
        set_at=row["set_at"],
        set_by=row["set_by"],
        backdate_reason=row["backdate_reason"],
    )
