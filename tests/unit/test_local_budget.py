"""The worker-local budgets of the `local` failure mode (domain/local_budget.py)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from llmquota.domain.local_budget import (
    BudgetHold,
    BudgetRefusal,
    LocalBudgets,
    ModelPrice,
    OutageBudgets,
    QuotaFigures,
    like_pattern,
)

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
MIDNIGHT = datetime(2026, 12, 3, tzinfo=UTC)


def daily(tokens: int, used: int, *, patterns: tuple[str, ...] = ()) -> QuotaFigures:
    return QuotaFigures(
        quota_id=7,
        name="daily",
        tenant="acme",
        route=None,
        model_patterns=patterns,
        tokens=tokens,
        cost=None,
        used_tokens=used,
        used_cost=Decimal(0),
        window_end=MIDNIGHT,
    )


def test_like_patterns_read_as_the_database_reads_them() -> None:
    assert like_pattern("gpt-4o-%").fullmatch("gpt-4o-2024-08-06")
    assert not like_pattern("gpt-4o-%").fullmatch("gpt-4o")
    assert like_pattern("m_").fullmatch("m1") and not like_pattern("m_").fullmatch("m12")
    # escaped LIKE characters are literal (a model name with % or _ in it)
    assert like_pattern(r"a\_b").fullmatch("a_b") and not like_pattern(r"a\_b").fullmatch("axb")
    assert like_pattern("a.b").fullmatch("a.b") and not like_pattern("a.b").fullmatch("axb")


def test_a_quota_admits_its_share_of_what_was_left_then_refuses() -> None:
    budgets = OutageBudgets(quotas=(daily(5_000, 1_000),))
    local = LocalBudgets(fraction=0.5)  # 2,000 of the 4,000 left
    args = {"tenant": "acme", "route": None, "model": "m", "prepaid": False, "now": NOW}
    for i in range(2):
        hold = local.admit(budgets, input_tokens=0, max_tokens=1_000, **args)
        assert isinstance(hold, BudgetHold) and hold.quota_ids == (7,)
        local.hold(uuid.UUID(int=i), hold)
    refused = local.admit(budgets, input_tokens=0, max_tokens=1, **args)
    assert isinstance(refused, BudgetRefusal) and refused.kind == "quota_exceeded"
    # A settle keeps what was used (300), a release nothing: 1,700 free again.
    local.finish(uuid.UUID(int=0), 300, Decimal(0))
    local.finish(uuid.UUID(int=1), 0, Decimal(0))
    assert isinstance(local.admit(budgets, input_tokens=0, max_tokens=1_700, **args), BudgetHold)
    assert isinstance(local.admit(budgets, input_tokens=0, max_tokens=1_701, **args), BudgetRefusal)
    # After midnight the window the figures were of has ended: the whole
    # limit's share (2,500), less what this worker holds (300).
    later = {**args, "now": MIDNIGHT + timedelta(seconds=1)}
    assert isinstance(local.admit(budgets, input_tokens=0, max_tokens=2_200, **later), BudgetHold)
    assert isinstance(
        local.admit(budgets, input_tokens=0, max_tokens=2_201, **later), BudgetRefusal
    )


def test_a_quota_of_other_models_does_not_bind() -> None:
    budgets = OutageBudgets(quotas=(daily(1_000, 1_000, patterns=("gpt-%",)),))
    local = LocalBudgets(fraction=0.5)
    hold = local.admit(
        budgets,
        tenant="acme",
        route=None,
        model="claude",
        input_tokens=0,
        max_tokens=500,
        prepaid=False,
        now=NOW,
    )
    assert isinstance(hold, BudgetHold) and hold.quota_ids == ()


def test_a_prepaid_balance_admits_its_share_and_an_unpriced_model_not_at_all() -> None:
    budgets = OutageBudgets(
        credits={"acme": Decimal("0.04")},
        prices={"gpt-4o": ModelPrice(Decimal("2.50"), Decimal("10.00"))},
    )
    local = LocalBudgets(fraction=0.5)  # $0.02
    common = {"tenant": "acme", "route": None, "prepaid": True, "now": NOW}
    first = local.admit(budgets, model="gpt-4o", input_tokens=100, max_tokens=900, **common)
    assert isinstance(first, BudgetHold) and first.money == Decimal("0.00925")
    local.hold(uuid.UUID(int=1), first)
    short = local.admit(budgets, model="gpt-4o", input_tokens=100, max_tokens=1_100, **common)
    assert short == BudgetRefusal("credits_exhausted", available=Decimal("0.01075"))
    unpriced = local.admit(budgets, model="other", input_tokens=1, max_tokens=1, **common)
    assert unpriced == BudgetRefusal("unpriced_model")


def test_a_recorded_hold_counts_until_budgets_taken_after_it_replace_the_figures() -> None:
    budgets = OutageBudgets(quotas=(daily(2_000, 0),))
    local = LocalBudgets(fraction=0.5)  # 1,000
    args = {"tenant": "acme", "route": None, "model": "m", "prepaid": False, "now": NOW}
    hold = local.admit(budgets, input_tokens=0, max_tokens=1_000, **args)
    assert isinstance(hold, BudgetHold)
    local.hold(uuid.UUID(int=1), hold)
    before = local.epoch()  # a refresh asked before the store had it
    local.recorded(uuid.UUID(int=1))
    local.rebase(before)
    assert isinstance(local.admit(budgets, input_tokens=0, max_tokens=1, **args), BudgetRefusal)
    after = local.epoch()  # a refresh asked once the store had it: its figures include it
    local.rebase(after)
    assert isinstance(local.admit(budgets, input_tokens=0, max_tokens=1_000, **args), BudgetHold)
