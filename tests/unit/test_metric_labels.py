"""The metrics' labels stay bounded: reasons from a closed vocabulary, free names capped."""

from __future__ import annotations

from typing import Any

from llmquota.domain.records import AdmitDecision, TenantFigures
from llmquota.metrics import OTHER_LABEL, BoundedLabels, decision_outcome, decision_reason


def decision(status: str, **fields: Any) -> AdmitDecision:
    values: dict[str, Any] = dict.fromkeys(
        (
            "reservation_id",
            "reserved_tokens",
            "lease_expires_at",
            "lease_generation",
            "limit_kind",
            "limit_scope",
            "retry_after_ms",
            "capacity",
            "remaining_tokens",
            "remaining_requests",
            "remaining_in_flight",
        )
    )
    values.update(status=status, tenant=TenantFigures(None, None, None, None, None, None))
    values.update(fields)
    return AdmitDecision(**values)


def test_reasons_name_the_scope_and_kind_or_the_ceiling_and_why() -> None:
    cases = {
        ("rate_limited", "tokens", "tenant", None): "tenant_tokens",
        ("rate_limited", "requests", "tenant", None): "tenant_requests",
        ("rate_limited", "tokens", "global", None): "global_tokens",
        ("rate_limited", "tokens", "route", None): "route_tokens",
        ("rate_limited", "concurrency", "route", None): "concurrency",
        ("rate_limited", "tokens", "ceiling", "shed"): "ceiling_shed",
        ("rate_limited", "tokens", "ceiling", "capacity"): "ceiling_capacity",
        ("too_large", "tokens", "ceiling", "capacity"): "too_large",
        ("admitted", None, None, None): "none",
    }
    for (status, kind, scope, reason), expected in cases.items():
        d = decision(status, limit_kind=kind, limit_scope=scope, reason=reason)
        assert decision_reason(d) == expected, (status, kind, scope, reason)


def test_outcomes_tell_degraded_admissions_apart() -> None:
    assert decision_outcome(decision("admitted")) == "admitted"
    assert decision_outcome(decision("replayed")) == "admitted"
    assert decision_outcome(decision("admitted", degraded=True)) == "degraded"
    assert decision_outcome(decision("rate_limited")) == "refused"


def test_free_form_labels_beyond_the_limit_are_other() -> None:
    labels = BoundedLabels(limit=2)
    assert [labels(m) for m in ("a", "b", "c", "a", "d")] == [
        "a",
        "b",
        OTHER_LABEL,
        "a",
        OTHER_LABEL,
    ]
    assert labels(None) == "none"
