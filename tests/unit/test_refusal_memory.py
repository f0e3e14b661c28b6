"""The worker's memory of rate-limit refusals (admission/refusals.py), as pure code."""

from __future__ import annotations

from llmquota.admission.refusals import RefusalMemory
from llmquota.domain.records import AdmitDecision, AdmitRequest, FinishResult, TenantFigures

NO_FIGURES = TenantFigures(None, None, None, None, None, None)


def request(tenant: str = "acme", input_tokens: int = 500, **fields: object) -> AdmitRequest:
    base = AdmitRequest(tenant, None, "gpt-4o", input_tokens, 100, False, None, None, None)
    return base._replace(**fields)


def refusal(retry_after_ms: int = 30_000, status: str = "rate_limited") -> AdmitDecision:
    return AdmitDecision(
        status,  # type: ignore[arg-type]
        None,
        None,
        None,
        None,
        "tokens",
        "tenant",
        retry_after_ms,
        None,
        0,
        0,
        0,
        NO_FIGURES,
    )


def test_a_refusal_stands_for_the_same_request_for_at_most_100_ms() -> None:
    memory = RefusalMemory(0.1)
    memory.remember(request(), refusal(30_000), now=10.0)

    recalled = memory.recall(request(), now=10.04)
    assert recalled is not None and recalled.status == "rate_limited"
    # The hint is counted down by the 40 ms since it was decided.
    assert recalled.retry_after_ms == 29_960
    assert memory.recall(request(lease_seconds=60, request_hash="h"), now=10.09) is not None
    # Past 100 ms the store decides again, and the entry is gone.
    assert memory.recall(request(), now=10.1) is None
    assert len(memory) == 0


def test_a_short_retry_hint_ends_the_memory_sooner() -> None:
    memory = RefusalMemory(0.1)
    memory.remember(request(), refusal(retry_after_ms=20), now=0.0)
    assert memory.recall(request(), now=0.019) is not None
    assert memory.recall(request(), now=0.020) is None


def test_any_other_request_goes_to_the_store() -> None:
    """A smaller request may fit; a larger one may be too large for some layer
    (a 413 only the store knows): only the same request is answered from memory."""
    memory = RefusalMemory(0.1)
    mini = (("gpt-4o-mini", 500),)
    memory.remember(request(fallbacks=mini), refusal(), now=0.0)
    assert memory.recall(request(input_tokens=499, fallbacks=mini), 0.01) is None
    assert memory.recall(request(input_tokens=5_000, fallbacks=mini), 0.01) is None
    assert memory.recall(request(max_tokens=99, fallbacks=mini), 0.01) is None
    assert memory.recall(request(max_tokens=101, fallbacks=mini), 0.01) is None
    assert memory.recall(request(fallbacks=(("gpt-4o-mini", 499),)), 0.01) is None
    assert memory.recall(request(), now=0.01) is None  # no fallbacks
    assert memory.recall(request(route="chat", fallbacks=mini), 0.01) is None
    assert memory.recall(request(priority="critical", fallbacks=mini), 0.01) is None
    assert memory.recall(request(tenant="other", fallbacks=mini), 0.01) is None
    assert memory.recall(request(fallbacks=mini), now=0.01) is not None


def test_only_rate_limit_refusals_without_idempotency_keys_are_remembered() -> None:
    memory = RefusalMemory(0.1)
    memory.remember(request(), refusal(status="quota_exceeded"), now=0.0)
    memory.remember(request(tenant="b", idempotency_key="k1"), refusal(), now=0.0)
    memory.remember(request(tenant="c"), refusal(retry_after_ms=0), now=0.0)
    assert len(memory) == 0
    memory.remember(request(), refusal(), now=0.0)
    # A retry under an idempotency key must get its earlier admission back.
    assert memory.recall(request(idempotency_key="k2"), now=0.01) is None
    assert memory.recall(request(), now=0.01) is not None


def test_a_finished_reservation_of_the_tenant_forgets_its_refusals() -> None:
    memory = RefusalMemory(0.1)
    memory.remember(request(), refusal(), now=0.0)
    memory.remember(request(tenant="other"), refusal(), now=0.0)
    memory.forget_finished(
        [
            FinishResult("not_found", None, None, None, None, None),
            RuntimeError("a refused row"),
            FinishResult("released", "released", "acme", 0, 600, False),
        ]
    )
    assert memory.recall(request(), now=0.01) is None
    assert memory.recall(request(tenant="other"), now=0.01) is not None
    memory.forget_all()
    assert memory.recall(request(tenant="other"), now=0.01) is None


def test_zero_memory_remembers_nothing() -> None:
    memory = RefusalMemory(0.0)
    memory.remember(request(), refusal(), now=0.0)
    assert memory.recall(request(), now=0.0) is None
