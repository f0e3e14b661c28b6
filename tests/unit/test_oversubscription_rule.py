"""The oversubscription report's period and rule: bounds, defaults, the settings they come from."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from llmquota.config import Settings
from llmquota.domain.errors import InvalidRequest
from llmquota.domain.oversubscription import (
    DEFAULT_DAYS,
    MAX_DAYS,
    OversubscriptionRule,
    check_days,
    verdict_of,
)


def test_the_period_is_a_week_by_default_and_at_most_a_year() -> None:
    assert (DEFAULT_DAYS, MAX_DAYS) == (7, 366)
    assert check_days(1) == 1
    assert check_days(MAX_DAYS) == MAX_DAYS


@pytest.mark.parametrize("days", [0, -7, MAX_DAYS + 1, True, 7.0, "7"])
def test_a_period_outside_the_bounds_is_refused_naming_days(days: object) -> None:
    with pytest.raises(InvalidRequest, match=r"^days: a whole number of days from 1 to 366"):
        check_days(days)  # type: ignore[arg-type]


def test_the_default_rule_is_seed_001s_two_to_three_times() -> None:
    rule = OversubscriptionRule()
    assert (rule.warn_above, rule.critical_above) == (2.0, 3.0)
    assert Settings(_env_file=None).oversubscription_rule == rule  # type: ignore[call-arg]


@pytest.mark.parametrize(("warn", "critical"), [(3.0, 2.0), (0.0, 1.0), (1.0, 1_001.0)])
def test_a_rule_out_of_order_or_bounds_is_refused(warn: float, critical: float) -> None:
    with pytest.raises(ValueError, match="oversubscription rule"):
        OversubscriptionRule(warn_above=warn, critical_above=critical)


def test_the_rule_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMQUOTA_OVERSUBSCRIPTION_WARN_RATIO", "1.5")
    monkeypatch.setenv("LLMQUOTA_OVERSUBSCRIPTION_CRITICAL_RATIO", "2.5")
    rule = Settings(_env_file=None).oversubscription_rule  # type: ignore[call-arg]
    assert (rule.warn_above, rule.critical_above) == (1.5, 2.5)
    # warn and critical may be one threshold: nothing is then `warn`
    monkeypatch.setenv("LLMQUOTA_OVERSUBSCRIPTION_CRITICAL_RATIO", "1.5")
    assert Settings(_env_file=None).oversubscription_rule.critical_above == 1.5  # type: ignore[call-arg]


def test_a_critical_ratio_below_the_warn_ratio_is_a_configuration_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LLMQUOTA_OVERSUBSCRIPTION_WARN_RATIO", "3")
    monkeypatch.setenv("LLMQUOTA_OVERSUBSCRIPTION_CRITICAL_RATIO", "2")
    with pytest.raises(ValidationError, match="OVERSUBSCRIPTION_CRITICAL_RATIO"):
        Settings(_env_file=None)  # type: ignore[call-arg]


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan", "1001", "two"])
def test_a_ratio_out_of_bounds_is_a_configuration_error(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("LLMQUOTA_OVERSUBSCRIPTION_WARN_RATIO", value)
    with pytest.raises(ValidationError):
        Settings(_env_file=None)  # type: ignore[call-arg]


def test_a_verdict_outside_the_vocabulary_is_an_error_not_a_verdict() -> None:
    assert [verdict_of(v) for v in ("ok", "warn", "critical")] == ["ok", "warn", "critical"]
    with pytest.raises(ValueError, match="unknown verdict 'bad'"):
        verdict_of("bad")
