"""One refusal table: the library, the REST API and proxy mode answer each refused
status as its row says (domain/refusal_table.py).

Each refusal a decision can carry is built here and answered on all three
paths; the exception class, the HTTP status, the REST error type and the
retry headers must be the row's on each.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from decimal import Decimal
from typing import get_args

import pytest

from llmquota.admission.reservation import Admission
from llmquota.api.proxy.wire import refusal as proxy_refusal
from llmquota.api.refusals import refusal_response
from llmquota.domain.errors import (
    CreditsExhausted,
    LimiterError,
    QuotaExceeded,
    RateLimited,
    RequestTooLarge,
    UnpricedModel,
)
from llmquota.domain.records import AdmitDecision, TenantFigures
from llmquota.domain.refusal_table import REFUSALS
from llmquota.domain.vocabulary import AdmitStatus

FIGURES = TenantFigures(60_000, 60_000, 10.0, None, None, None)
EXPECTED: dict[str, tuple[type[LimiterError], int, str]] = {
    "rate_limited": (RateLimited, 429, "rate_limit_error"),
    "quota_exceeded": (QuotaExceeded, 429, "insufficient_quota"),
    "credits_exhausted": (CreditsExhausted, 402, "credits_exhausted"),
    "unpriced_model": (UnpricedModel, 422, "invalid_request_error"),
    "too_large": (RequestTooLarge, 413, "request_too_large"),
}


def refused(status: AdmitStatus) -> AdmitDecision:
    return AdmitDecision(
        status=status,
        reservation_id=None,
        reserved_tokens=5_000,
        lease_expires_at=None,
        lease_generation=None,
        limit_kind="tokens",
        limit_scope="tenant",
        retry_after_ms=1_500,
        capacity=4_000,
        remaining_tokens=10,
        remaining_requests=None,
        remaining_in_flight=None,
        tenant=FIGURES,
        model="gpt-4o",
        reason="tokens",
        quota="daily",
        resets_at=datetime(2026, 12, 3, tzinfo=UTC),
        credit_balance=Decimal("0.019960000000"),
    )


def test_every_refused_status_has_one_row_and_no_other_status_has_one() -> None:
    statuses = set(get_args(AdmitStatus))
    assert set(REFUSALS) == set(EXPECTED)
    assert set(REFUSALS) <= statuses
    assert statuses - set(REFUSALS) == {
        "admitted",
        "replayed",
        "unknown_tenant",
        "idempotency_conflict",
    }


@pytest.mark.parametrize("status", sorted(EXPECTED))
def test_the_library_the_rest_api_and_the_proxy_answer_a_refusal_as_its_row_says(
    status: AdmitStatus,
) -> None:
    rule = REFUSALS[status]
    error_class, http_status, error_type = EXPECTED[status]
    assert (rule.http_status, rule.error_type) == (http_status, error_type)
    decision = refused(status)

    with pytest.raises(error_class) as raised:
        Admission(decision, 100, False, None).raise_for_refusal("acme")
    assert type(raised.value) is error_class

    rest = refusal_response("acme", decision, {})
    assert rest is not None and rest.status_code == http_status
    body = json.loads(bytes(rest.body))
    assert body["error"]["type"] == error_type
    assert ("retry-after-ms" in rest.headers) is rule.retry
    if rule.retry:
        assert rest.headers["retry-after"] == "2" and body["error"]["retry_after_ms"] == 1_500

    for kind in ("openai", "anthropic"):
        provider = proxy_refusal(kind, "acme", decision)
        assert provider is not None and provider.status_code == http_status
        assert ("retry-after-ms" in provider.headers) is rule.retry
        assert (provider.headers.get("x-should-retry") == "false") is rule.never_retry


def test_money_in_a_refusal_is_a_decimal_string_of_at_most_six_places() -> None:
    rest = refusal_response("acme", refused("credits_exhausted"), {})
    assert rest is not None
    assert json.loads(bytes(rest.body))["error"]["balance"] == "0.01996"
