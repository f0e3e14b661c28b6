"""Calendar quotas and prepaid credits: their records and the checks on their input.

Pure. The REST routes and the CLI hand raw values to these functions, which
either return the typed value or raise InvalidRequest naming the field, so
every entry point refuses the same input with the same words. The windows
themselves are computed by PostgreSQL (lq_quota_window), where admission
reads them; nothing here needs the clock.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal, InvalidOperation
from typing import Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError, available_timezones

from llmquota.domain.errors import InvalidRequest
from llmquota.domain.validation import check_model_glob, check_text

Period = Literal["day", "month"]
Enforce = Literal["block", "alert_only"]
PERIODS: tuple[Period, ...] = ("day", "month")
ENFORCE_MODES: tuple[Enforce, ...] = ("block", "alert_only")

DEFAULT_ALERTS = (Decimal("0.5"), Decimal("0.8"), Decimal("0.95"), Decimal("1.0"))
# Limits on what one quota may say (the database checks the same or wider).
MAX_ALERTS = 20
MAX_MODELS = 50
MAX_QUOTA_TOKENS = 10**15
# Money: decimal strings, at most this many places and this large.
MAX_AMOUNT_PLACES = 12
MAX_AMOUNT = Decimal(10**15)
MAX_REFERENCE_CHARS = 255
# Zone names as the IANA database spells them; "localtime" and friends are
# files of the zone directory, not zones.
_ZONE_NAME = re.compile(r"^[A-Za-z0-9_+-]+(/[A-Za-z0-9_+-]+)*$")
_NOT_ZONES = frozenset({"localtime", "posixrules", "Factory", "posix", "right"})
# A decimal string below MAX_AMOUNT with at most MAX_AMOUNT_PLACES places and
# no leading zero: the OpenAPI document shows this pattern, so it is the rule.
AMOUNT_PATTERN = rf"^(0|[1-9][0-9]{{0,14}})(\.[0-9]{{1,{MAX_AMOUNT_PLACES}}})?$"
# An amount that is zero (refused where an amount must be positive).
ZERO_AMOUNT_PATTERN = r"^0(\.0+)?$"
_AMOUNT = re.compile(AMOUNT_PATTERN)


@dataclass(frozen=True, slots=True)
class QuotaSpec:
    """A quota as an operator sets it (PUT body), validated."""

    period: Period
    timezone: str = "UTC"
    tokens: int | None = None
    cost: Decimal | None = None
    models: tuple[str, ...] = ()
    alerts: tuple[Decimal, ...] = DEFAULT_ALERTS
    enforce: Enforce = "block"

    @property
    def model_patterns(self) -> tuple[str, ...]:
        """The models as SQL LIKE patterns, in the same order."""
        return tuple(glob_to_like(model) for model in self.models)


@dataclass(frozen=True, slots=True)
class Quota:
    """A stored quota with its current calendar window and that window's usage."""

    quota_id: int
    tenant: str
    route: str | None
    name: str
    spec: QuotaSpec
    window_start: datetime
    window_end: datetime
    usage_tokens: int
    usage_cost: Decimal
    created_at: datetime
    updated_at: datetime
    # A key's quota: that key's id (None: the tenant's or a route's).
    key_id: int | None = None


@dataclass(frozen=True, slots=True)
class TopUp:
    """One credit top-up; `applied` False when its reference had been used before."""

    entry_id: int
    amount: Decimal
    reference: str
    recorded_at: datetime
    applied: bool = True


@dataclass(frozen=True, slots=True)
class CreditAccount:
    """A tenant's prepaid balance, what open reservations hold, and the last top-ups."""

    tenant: str
    balance: Decimal
    reserved: Decimal
    topups: tuple[TopUp, ...]

    @property
    def available(self) -> Decimal:
        return self.balance - self.reserved


def check_period(value: object) -> Period:
    """`day` or `month`: calendar windows, never rolling ones."""
    if value == "day":
        return "day"
    if value == "month":
        return "month"
    raise InvalidRequest("period must be 'day' or 'month'")


def check_enforce(value: object) -> Enforce:
    """`block` (refuse past the quota) or `alert_only` (count and alert, never refuse)."""
    if value == "block":
        return "block"
    if value == "alert_only":
        return "alert_only"
    raise InvalidRequest("enforce must be 'block' or 'alert_only'")


def check_timezone(value: object) -> str:
    """An IANA time zone name the zone database knows, e.g. Europe/Berlin."""
    if (
        not isinstance(value, str)
        or len(value) > 64
        or not _ZONE_NAME.fullmatch(value)
        or value.split("/")[0] in _NOT_ZONES
    ):
        raise InvalidRequest("timezone must be an IANA time zone name such as Europe/Berlin")
    try:
        ZoneInfo(value)
    except (ZoneInfoNotFoundError, ValueError, OSError) as exc:
        raise InvalidRequest(f"timezone {value!r} is not a known IANA time zone") from exc
    return value


@functools.cache
def known_timezones() -> list[str]:
    """Every zone name check_timezone takes, sorted: the schema's enum of them."""
    return sorted(
        zone
        for zone in available_timezones()
        if len(zone) <= 64 and _ZONE_NAME.fullmatch(zone) and zone.split("/")[0] not in _NOT_ZONES
    )


def check_amount(field: str, value: object, *, allow_zero: bool = False) -> Decimal:
    """A decimal string (never a JSON number: floats lose cents), positive, bounded."""
    if not isinstance(value, str) or not _AMOUNT.fullmatch(value):
        raise InvalidRequest(
            f'{field} must be a decimal string such as "12.50" (no leading zeros, at most '
            f"{MAX_AMOUNT_PLACES} places, below {MAX_AMOUNT})"
        )
    try:
        amount = Decimal(value)
    except InvalidOperation as exc:  # pragma: no cover - the pattern admits only decimals
        raise InvalidRequest(f"{field} must be a decimal string") from exc
    places = -int(amount.as_tuple().exponent)
    if places > MAX_AMOUNT_PLACES:
        raise InvalidRequest(f"{field} has more than {MAX_AMOUNT_PLACES} decimal places")
    if amount >= MAX_AMOUNT or (amount == 0 and not allow_zero):
        raise InvalidRequest(f"{field} must be greater than 0 and below {MAX_AMOUNT}")
    return amount


def check_quota_tokens(value: object) -> int | None:
    """A token budget: a positive integer, or None for none."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_QUOTA_TOKENS:
        raise InvalidRequest(f"tokens must be an integer from 1 to {MAX_QUOTA_TOKENS}")
    return value


def check_alerts(value: object) -> tuple[Decimal, ...]:
    """Alert thresholds: fractions in (0, 1], at most MAX_ALERTS, stored increasing."""
    if value is None:
        return DEFAULT_ALERTS
    if not isinstance(value, list | tuple) or len(value) > MAX_ALERTS:
        raise InvalidRequest(f"alerts must be a list of at most {MAX_ALERTS} fractions")
    fractions: list[Decimal] = []
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int | float | str):
            raise InvalidRequest("alerts must be numbers in (0, 1]")
        try:
            fraction = Decimal(str(item))
        except InvalidOperation as exc:
            raise InvalidRequest("alerts must be numbers in (0, 1]") from exc
        if not fraction.is_finite() or not 0 < fraction <= 1:
            raise InvalidRequest("alerts must be numbers in (0, 1]")
        fractions.append(fraction)
    # A set of thresholds: in whatever order they came, each alerts once. (No
    # JSON Schema can say "increasing", so the server does not ask for it.)
    return tuple(sorted(set(fractions)))


def check_models(value: object) -> tuple[str, ...]:
    """Model names and `*` globs (e.g. `gpt-4o*`); empty: every model."""
    if value is None:
        return ()
    if not isinstance(value, list | tuple) or len(value) > MAX_MODELS:
        raise InvalidRequest(f"models must be a list of at most {MAX_MODELS} names or globs")
    return tuple(check_model_glob(item, "models") for item in value)


def glob_to_like(pattern: str) -> str:
    """A `*` glob as a LIKE pattern: `*` matches anything, LIKE's own `%`, `_`
    and `\\` match themselves."""
    escaped = pattern.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return escaped.replace("*", "%")


def quota_spec(
    *,
    period: object,
    timezone: object = "UTC",
    tokens: object = None,
    cost: object = None,
    models: object = None,
    alerts: object = None,
    enforce: object = "block",
) -> QuotaSpec:
    """A QuotaSpec from raw values, or InvalidRequest naming the first bad field."""
    spec = QuotaSpec(
        period=check_period(period),
        timezone=check_timezone("UTC" if timezone is None else timezone),
        tokens=check_quota_tokens(tokens),
        cost=None if cost is None else check_amount("cost", cost),
        models=check_models(models),
        alerts=check_alerts(alerts),
        enforce=check_enforce("block" if enforce is None else enforce),
    )
    if spec.tokens is None and spec.cost is None:
        raise InvalidRequest("tokens or cost: a quota needs at least one of them")
    return spec


def check_reference(value: object) -> str:
    """A top-up's idempotency reference: 1 to MAX_REFERENCE_CHARS storable characters."""
    return check_text("reference", value, MAX_REFERENCE_CHARS)
