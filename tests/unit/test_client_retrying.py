"""The REST client's decisions, without a server: when to try again, and what a refusal raises.

Pure code (llmquota.client.retrying, .wire and .errors) fed with answers in
the API's shape, on a clock the test moves; the client's behaviour against a
real server is tests/acceptance/test_client.py.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest

from llmquota.client.errors import LimiterUnreachable, UnexpectedResponse, error_of
from llmquota.client.retrying import (
    BACKOFF_MAX_SECONDS,
    MAX_RETRIES_CAP,
    MIN_RATE_LIMIT_WAIT_MS,
    Retrying,
    check_max_retries,
)
from llmquota.client.wire import GENERATED_KEY_PREFIX, Answer, admit_body, check_max_wait_ms
from llmquota.domain.errors import (
    CreditsExhausted,
    IdempotencyConflict,
    InvalidRequest,
    QuotaExceeded,
    RateLimited,
    ReservationConflict,
    ReservationNotFound,
    StoreUnavailable,
    UnknownTenant,
    UnpricedModel,
)


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _answer(status: int, headers: dict[str, str] | None = None, **error: Any) -> Answer:
    body = {"type": "error", "error": error} if error else {}
    return Answer(status, headers or {}, json.dumps(body))


def _refused(retry_after_ms: int) -> Answer:
    return _answer(
        429,
        {"retry-after": str(-(-retry_after_ms // 1000)), "retry-after-ms": str(retry_after_ms)},
        type="rate_limit_error",
        message="tenant 'acme' is out of tokens",
        limit="tokens",
        scope="tenant",
        retry_after_ms=retry_after_ms,
    )


def test_a_429_is_waited_out_at_its_hint_while_the_call_stays_within_max_wait_ms() -> None:
    clock = Clock()
    retrying = Retrying(max_wait_ms=1_000, max_retries=3, clock=clock)
    assert retrying.after_refusal(_refused(400)) == 0.4
    clock.now += 0.45  # slept 0.4 s, the attempt took 50 ms: 450 ms of 1,000 gone
    assert retrying.after_refusal(_refused(500)) == 0.5  # ends at 950 ms
    clock.now += 0.5
    assert retrying.after_refusal(_refused(100)) is None  # would end at 1,050 ms
    assert retrying.waited_seconds == pytest.approx(0.9)


def test_without_max_wait_ms_a_429_stands_at_once() -> None:
    assert Retrying(0, 3, Clock()).after_refusal(_refused(1)) is None


def test_a_1_ms_hint_waits_the_floor_so_a_wait_cannot_spin() -> None:
    assert Retrying(1_000, 3, Clock()).after_refusal(_refused(1)) == MIN_RATE_LIMIT_WAIT_MS / 1000


def test_the_hint_is_the_most_precise_the_server_gave() -> None:
    assert _answer(429, {"retry-after-ms": "1234", "retry-after": "2"}).retry_after_ms() == 1234
    assert _answer(429, {"retry-after": "2"}, type="x", retry_after_ms=1500).retry_after_ms() == (
        1500
    )
    assert _answer(429, {"retry-after": "2"}).retry_after_ms() == 2000
    assert _answer(429, {"retry-after": "Wed, 21 Oct 2026 07:28:00 GMT"}).retry_after_ms() is None


def test_503s_and_transport_failures_are_retried_max_retries_times_in_all() -> None:
    retrying = Retrying(0, 3, Clock())
    unavailable = _answer(503, {"retry-after": "1"}, type="limiter_unavailable", message="retry")
    first = retrying.after_refusal(unavailable)
    assert first is not None and 1.0 <= first <= BACKOFF_MAX_SECONDS  # never before Retry-After
    second, third = retrying.after_failure(), retrying.after_failure()
    assert second is not None and third is not None
    assert 0 < second <= third <= BACKOFF_MAX_SECONDS  # backoff grows (jitter within a doubling)
    assert retrying.after_failure() is None
    assert retrying.after_refusal(unavailable) is None
    assert Retrying(0, 0, Clock()).after_failure() is None


@pytest.mark.parametrize("status", [400, 401, 402, 403, 404, 409, 413, 422])
def test_answers_that_cannot_change_are_never_retried(status: int) -> None:
    answer = _answer(status, {"retry-after": "1"}, type="some_error", message="no")
    assert Retrying(60_000, MAX_RETRIES_CAP, Clock()).after_refusal(answer) is None


def test_max_retries_is_bounded() -> None:
    assert check_max_retries(MAX_RETRIES_CAP) == MAX_RETRIES_CAP
    for bad in (-1, MAX_RETRIES_CAP + 1, True, 2.5):
        with pytest.raises(InvalidRequest):
            check_max_retries(bad)  # type: ignore[arg-type]


def test_an_admission_always_carries_an_idempotency_key_unless_it_cannot_be_retried() -> None:
    fields: Any = {"tenant": "acme", "model": "gpt-4o", "max_tokens": 10, "input_tokens": 5}
    generated = admit_body(fields, generate_key=True)
    assert generated["idempotency_key"].startswith(GENERATED_KEY_PREFIX)
    assert admit_body(fields, generate_key=True)["idempotency_key"] != generated["idempotency_key"]
    assert "idempotency_key" not in admit_body(fields, generate_key=False)
    own = admit_body({**fields, "idempotency_key": "job-7", "route": None}, generate_key=True)
    assert own == {**fields, "idempotency_key": "job-7"}  # the caller's key; None left out


def test_refusals_raise_the_librarys_classes_with_the_servers_figures() -> None:
    limited = error_of(_refused(2_500), UnknownTenant)
    assert type(limited) is RateLimited
    assert (limited.limit, limited.scope, limited.retry_after_ms) == ("tokens", "tenant", 2_500)
    quota = error_of(
        _answer(
            429,
            type="insufficient_quota",
            message="monthly quota",
            limit="quota",
            scope="tenant",
            quota="monthly-tokens",
            resets_at="2026-01-01T00:00:00+00:00",
            retry_after_ms=9_000,
        ),
        UnknownTenant,
    )
    assert isinstance(quota, QuotaExceeded)
    assert (quota.quota, quota.resets_at) == ("monthly-tokens", datetime(2026, 1, 1, tzinfo=UTC))
    credits = error_of(_answer(402, type="credits_exhausted", balance="-1.250000"), UnknownTenant)
    assert isinstance(credits, CreditsExhausted) and credits.balance == Decimal("-1.25")


@pytest.mark.parametrize(
    ("status", "error", "expected"),
    [
        (422, {"type": "invalid_request_error"}, InvalidRequest),
        (422, {"type": "invalid_request_error", "model": "gpt-x"}, UnpricedModel),
        (422, {"type": "idempotency_conflict"}, IdempotencyConflict),
        (404, {"type": "not_found_error"}, ReservationNotFound),
        (503, {"type": "limiter_unavailable"}, StoreUnavailable),
        (502, {"type": "bad_gateway"}, UnexpectedResponse),
    ],
)
def test_each_error_answer_raises_its_class(
    status: int, error: dict[str, Any], expected: type[Exception]
) -> None:
    raised = error_of(_answer(status, message="why", **error), ReservationNotFound)
    assert type(raised) is expected and str(raised).endswith("why")


def test_a_conflict_names_the_reservations_state() -> None:
    conflict = error_of(
        _answer(409, type="conflict_error", message="is expired", state="expired"),
        ReservationNotFound,
    )
    assert isinstance(conflict, ReservationConflict) and conflict.state == "expired"


def test_an_answer_not_in_llmquotas_shape_is_unexpected_and_unreachable_is_an_outage() -> None:
    html = Answer(502, {}, "<html>Bad Gateway</html>")
    raised = error_of(html, UnknownTenant)
    assert isinstance(raised, UnexpectedResponse) and raised.status == 502
    assert issubclass(LimiterUnreachable, StoreUnavailable)


def test_the_client_raises_the_very_classes_the_library_raises() -> None:
    import llmquota
    import llmquota.client

    for name in ("RateLimited", "RequestTooLarge", "QuotaExceeded", "StoreUnavailable"):
        assert getattr(llmquota.client, name) is getattr(llmquota, name)
    assert llmquota.client.Settlement is llmquota.Settlement


def test_a_bad_max_wait_ms_is_refused_before_anything_is_sent() -> None:
    assert check_max_wait_ms(0) == 0
    for bad in (-1, 1.5, True, "100"):
        with pytest.raises(InvalidRequest, match="max_wait_ms"):
            check_max_wait_ms(bad)  # type: ignore[arg-type]
