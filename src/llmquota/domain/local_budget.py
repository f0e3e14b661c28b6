"""Worker-local budgets for the `local` failure mode. Pure arithmetic, no I/O.

The layers' buckets (local_bucket.py) are not all a request passes: a
provider ceiling, the tenant's calendar quotas and its prepaid balance bind
too, and during an outage the database that holds them is away. A worker
therefore keeps, with its policy snapshot, the figures they had when it last
looked (`OutageBudgets`), and a `local` decision may use a fraction of what
was left of each (the same fraction as of the layers' limits, so several
workers doing the same stay within it between them): of a quota's remaining
tokens and cost in its window, and of a prepaid tenant's available balance.
A tenant out of credit is thus not served for free while the store is away.
(Provider ceilings are rate limits like any layer's: they get local buckets,
built from `CeilingFigures.policy`.)

What the worker's own outage admissions take is held here per reservation
(`LocalBudgets`): the maximum when admitted, what was used once settled,
nothing once released. A hold counts until the store holds the reservation
AND a newer snapshot of the budgets was taken after that (`rebase`), because
until then the last-known figures do not include it.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Literal

from llmquota.domain.ladder import LadderStep
from llmquota.domain.policy import Policy

BudgetRefusalKind = Literal["quota_exceeded", "credits_exhausted", "unpriced_model"]
MILLION = Decimal(1_000_000)


def like_pattern(pattern: str) -> re.Pattern[str]:
    """A LIKE pattern as the database stores model patterns (`%`, `_`, `\\` escapes)."""
    parts: list[str] = []
    escaped = False
    for char in pattern:
        if escaped:
            parts.append(re.escape(char))
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == "%":
            parts.append(".*")
        elif char == "_":
            parts.append(".")
        else:
            parts.append(re.escape(char))
    return re.compile("".join(parts), re.DOTALL)


def _matches(patterns: Sequence[re.Pattern[str]], model: str) -> bool:
    return any(p.fullmatch(model) for p in patterns)


@dataclass(frozen=True, slots=True)
class CeilingFigures:
    """A provider ceiling: its policy, and the models it covers (LIKE patterns)."""

    ceiling: str
    model_patterns: tuple[str, ...]
    policy: Policy
    policy_version: int
    # Its shedding ladder, when a step of it queues (domain/ladder.py); else ().
    ladder: tuple[LadderStep, ...] = ()
    # The one deployment it bounds (limit_layers.upstream); None: every one.
    upstream: str | None = None
    compiled: tuple[re.Pattern[str], ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "compiled", tuple(map(like_pattern, self.model_patterns)))

    def covers(self, model: str) -> bool:
        return _matches(self.compiled, model)


@dataclass(frozen=True, slots=True)
class QuotaFigures:
    """A blocking calendar quota and what its current window had used."""

    quota_id: int
    name: str
    tenant: str
    route: str | None
    model_patterns: tuple[str, ...]  # empty: every model
    tokens: int | None
    cost: Decimal | None
    used_tokens: int
    used_cost: Decimal
    window_end: datetime
    compiled: tuple[re.Pattern[str], ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "compiled", tuple(map(like_pattern, self.model_patterns)))

    def applies(self, tenant: str, route: str | None, model: str) -> bool:
        """As lq_matching_quotas: the tenant's own or its route's, for this model."""
        return (
            self.tenant == tenant
            and (self.route is None or self.route == route)
            and (not self.model_patterns or _matches(self.compiled, model))
        )

    def remaining(self, now: datetime) -> tuple[int | None, Decimal | None]:
        """(tokens, cost) left in the window as last known; a window that has
        ended since starts afresh (its usage then is unknown, never negative)."""
        if now >= self.window_end:
            return self.tokens, self.cost
        tokens = None if self.tokens is None else max(self.tokens - self.used_tokens, 0)
        cost = None if self.cost is None else max(self.cost - self.used_cost, Decimal(0))
        return tokens, cost


@dataclass(frozen=True, slots=True)
class ModelPrice:
    """A model's price in force, per million tokens."""

    input_per_million: Decimal
    output_per_million: Decimal


@dataclass(frozen=True, slots=True)
class OutageBudgets:
    """What a worker last knew of the ceilings, quotas, balances and prices."""

    ceilings: tuple[CeilingFigures, ...] = ()
    quotas: tuple[QuotaFigures, ...] = ()
    # prepaid tenants: balance - reserved, as last known
    credits: Mapping[str, Decimal] = field(default_factory=dict)
    prices: Mapping[str, ModelPrice] = field(default_factory=dict)

    def ceilings_for(self, model: str) -> list[CeilingFigures]:
        return [c for c in self.ceilings if c.covers(model)]

    def scoped_to_deployment(self, model: str) -> bool:
        """Whether some ceiling of `model` bounds only one of its deployments."""
        return any(c.upstream is not None for c in self.ceilings_for(model))

    def ladder_of(self, ceiling: str) -> tuple[LadderStep, ...]:
        """The ladder of a ceiling whose steps queue (() for any other, or unknown)."""
        for figures in self.ceilings:
            if figures.ceiling == ceiling:
                return figures.ladder
        return ()

    def quotas_for(self, tenant: str, route: str | None, model: str) -> list[QuotaFigures]:
        return [q for q in self.quotas if q.applies(tenant, route, model)]

    def cost(self, model: str, input_tokens: int, output_tokens: int) -> Decimal | None:
        """As lq_cost: None for a model without a price."""
        price = self.prices.get(model)
        if price is None:
            return None
        return (
            input_tokens * price.input_per_million + output_tokens * price.output_per_million
        ) / MILLION


@dataclass(frozen=True, slots=True)
class BudgetRefusal:
    """Why the local budgets refused: the quota used up, or the balance short."""

    kind: BudgetRefusalKind
    quota: QuotaFigures | None = None
    available: Decimal | None = None


@dataclass(slots=True)
class BudgetHold:
    """What one local admission takes of the quotas and the prepaid balance."""

    quota_ids: tuple[int, ...]
    prepaid_tenant: str | None
    tokens: int
    money: Decimal


@dataclass(slots=True)
class LocalBudgets:
    """This worker's outage admissions against the last-known budgets."""

    fraction: float
    _quota_tokens: dict[int, int] = field(default_factory=dict)
    _quota_money: dict[int, Decimal] = field(default_factory=dict)
    _credit_money: dict[str, Decimal] = field(default_factory=dict)
    _holds: dict[uuid.UUID, BudgetHold] = field(default_factory=dict)
    # holds the store has now, with the epoch they were recorded in
    _recorded: list[tuple[int, BudgetHold]] = field(default_factory=list)
    _epoch: int = 0

    def _share(self, amount: Decimal) -> Decimal:
        return amount * Decimal(str(self.fraction))

    def admit(
        self,
        budgets: OutageBudgets,
        *,
        tenant: str,
        route: str | None,
        model: str,
        input_tokens: int,
        max_tokens: int,
        prepaid: bool,
        now: datetime,
    ) -> BudgetRefusal | BudgetHold:
        """Check the request's quotas and balance; the hold it would take, or a refusal.

        Nothing is taken here: `hold` takes it once the admission is journaled.
        """
        cost = input_tokens + max_tokens
        money = budgets.cost(model, input_tokens, max_tokens)
        quotas = budgets.quotas_for(tenant, route, model)
        for quota in quotas:
            if quota.cost is not None and money is None:
                return BudgetRefusal("unpriced_model")
            tokens_left, cost_left = quota.remaining(now)
            if tokens_left is not None and (
                cost > self._share(Decimal(tokens_left)) - self._quota_tokens.get(quota.quota_id, 0)
            ):
                return BudgetRefusal("quota_exceeded", quota=quota)
            if (
                cost_left is not None
                and money is not None
                and money
                > self._share(cost_left) - self._quota_money.get(quota.quota_id, Decimal(0))
            ):
                return BudgetRefusal("quota_exceeded", quota=quota)
        if prepaid:
            available = self._share(budgets.credits.get(tenant, Decimal(0))) - (
                self._credit_money.get(tenant, Decimal(0))
            )
            if money is None:
                return BudgetRefusal("unpriced_model")
            if money > available:
                return BudgetRefusal("credits_exhausted", available=max(available, Decimal(0)))
        return BudgetHold(
            quota_ids=tuple(q.quota_id for q in quotas),
            prepaid_tenant=tenant if prepaid else None,
            tokens=cost,
            money=money if money is not None else Decimal(0),
        )

    def hold(self, reservation_id: uuid.UUID, hold: BudgetHold) -> None:
        """Take what an admission holds (it is journaled now)."""
        self._holds[reservation_id] = hold
        self._add(hold, 1)

    def finish(self, reservation_id: uuid.UUID, tokens: int, money: Decimal) -> None:
        """A settle (what was used) or a release (0, 0) replaces the maximum held."""
        hold = self._holds.get(reservation_id)
        if hold is None:
            return
        self._add(hold, -1)
        hold.tokens, hold.money = tokens, money
        self._add(hold, 1)

    def recorded(self, reservation_id: uuid.UUID) -> None:
        """The store holds this reservation now; it counts until the next rebase."""
        hold = self._holds.pop(reservation_id, None)
        if hold is not None:
            self._recorded.append((self._epoch, hold))

    def epoch(self) -> int:
        """A mark to take before asking the store for fresh budgets."""
        self._epoch += 1
        return self._epoch - 1

    def rebase(self, epoch: int) -> None:
        """Fresh budgets, asked for after `epoch`, include what was recorded by then."""
        keep: list[tuple[int, BudgetHold]] = []
        for recorded_in, hold in self._recorded:
            if recorded_in <= epoch:
                self._add(hold, -1)
            else:
                keep.append((recorded_in, hold))
        self._recorded = keep

    def _add(self, hold: BudgetHold, sign: int) -> None:
        for quota_id in hold.quota_ids:
            self._quota_tokens[quota_id] = self._quota_tokens.get(quota_id, 0) + sign * hold.tokens
            self._quota_money[quota_id] = (
                self._quota_money.get(quota_id, Decimal(0)) + sign * hold.money
            )
        if hold.prepaid_tenant is not None:
            tenant = hold.prepaid_tenant
            self._credit_money[tenant] = self._credit_money.get(tenant, Decimal(0)) + (
                sign * hold.money
            )
