"""What an admission gives the caller: the decision, and the reservation it holds.

An Admission is the store's (or the failure mode's) answer with what was
counted to reach it; refusals stay data until a caller asks for them as
exceptions. A Reservation is the handle a library caller settles, releases
or heartbeats; it only forwards to the Limiter, which owns every transition.
"""

from __future__ import annotations

import functools
import uuid
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import TYPE_CHECKING, NamedTuple

from llmquota.domain.errors import (
    CreditsExhausted,
    IdempotencyConflict,
    QuotaExceeded,
    RateLimited,
    RequestTooLarge,
    UnknownTenant,
    UnpricedModel,
)
from llmquota.domain.output_estimates import OutputEstimateInfo, OutputStrategy
from llmquota.domain.records import AdmitDecision
from llmquota.domain.refusals import refusal_message
from llmquota.domain.vocabulary import FailureMode, Outcome

if TYPE_CHECKING:
    from llmquota.admission.limiter import Limiter


class Admission(NamedTuple):
    """A decision with what the limiter counted to reach it.

    A NamedTuple for the same reason as AdmitDecision (domain/records.py):
    one is built per admission, and a frozen dataclass costs a call per field.
    """

    decision: AdmitDecision
    input_tokens: int
    input_estimated: bool
    # The failure mode that admitted or refused it while the store was away.
    fallback: FailureMode | None = None
    # How its output reservation was chosen (a failure mode reserves max_tokens).
    output_strategy: OutputStrategy = "max_tokens"

    @property
    def output_estimate(self) -> OutputEstimateInfo:
        """What was reserved for output, and how: reserved_tokens minus the input."""
        d = self.decision
        input_tokens = d.input_tokens if d.input_tokens is not None else self.input_tokens
        tokens = max(int(d.reserved_tokens or 0) - input_tokens, 0)
        return {"strategy": self.output_strategy, "tokens": tokens}

    def raise_for_refusal(self, tenant: str) -> None:
        """Raise the typed error for anything but an admission (or its replay)."""
        d = self.decision
        if d.status in ("admitted", "replayed"):
            return
        if d.status == "quota_exceeded" and d.quota and d.resets_at and d.limit_scope:
            raise QuotaExceeded(
                quota=d.quota,
                scope=d.limit_scope,
                resets_at=d.resets_at,
                retry_after_ms=int(d.retry_after_ms or 0),
                message=refusal_message(tenant, d),
            )
        if d.status == "credits_exhausted":
            raise CreditsExhausted(
                balance=d.credit_balance or Decimal(0), message=refusal_message(tenant, d)
            )
        if d.status == "unpriced_model":
            raise UnpricedModel(refusal_message(tenant, d))
        if d.status == "rate_limited" and d.limit_kind and d.limit_scope:
            raise RateLimited(
                limit=d.limit_kind,
                scope=d.limit_scope,
                retry_after_ms=int(d.retry_after_ms or 0),
                message=refusal_message(tenant, d),
            )
        if d.status == "too_large" and d.limit_scope:
            raise RequestTooLarge(
                scope=d.limit_scope,
                requested=int(d.reserved_tokens or 0),
                capacity=int(d.capacity or 0),
                message=refusal_message(tenant, d),
            )
        if d.status == "unknown_tenant":
            raise UnknownTenant(f"unknown tenant {tenant!r}")
        if d.status == "idempotency_conflict":
            raise IdempotencyConflict(
                "idempotency_key was already used for a different request by this tenant"
            )
        # lq_admit names the limit and scope of every refusal; a row without
        # them is a broken contract, not a caller's mistake.
        raise RuntimeError(f"refusal {d.status!r} without the limit that bound it")


@dataclass(frozen=True, slots=True)
class Settlement:
    """What settling charged and gave back."""

    charged_tokens: int
    refunded_tokens: int
    late: bool
    # Tokens above the request's possible maximum (counted input with a
    # tolerance, plus max_tokens): charged to the tenant, flagged in the
    # ledger, and kept off the shared layers (see lq_shared_charge_cap).
    excess_tokens: int = 0


class Reservation:
    """Admitted capacity held until settled, released or expired."""

    def __init__(self, limiter: Limiter, tenant: str, admission: Admission) -> None:
        d = admission.decision
        if d.reservation_id is None or d.lease_expires_at is None:
            raise RuntimeError("a reservation needs an admitted decision")
        self._limiter = limiter
        self.tenant = tenant
        self.reservation_id: uuid.UUID = d.reservation_id
        self.reserved_tokens = int(d.reserved_tokens or 0)
        self.input_tokens = d.input_tokens if d.input_tokens is not None else admission.input_tokens
        self.input_estimated = admission.input_estimated
        # The model admitted: a fallback when the requested one was refused.
        self.model: str | None = d.model
        self.degraded = d.degraded
        self.lease_expires_at: datetime = d.lease_expires_at
        self._admission = admission
        self.replayed = d.status == "replayed"
        self.settlement: Settlement | None = None
        self.released = False

    @functools.cached_property
    def output_estimate(self) -> OutputEstimateInfo:
        """{"strategy": "max_tokens" | "learned" | "fixed", "tokens": N}: reserved_tokens
        is the input plus N (see admission/estimates.py). Built when first read."""
        return self._admission.output_estimate

    @property
    def finished(self) -> bool:
        """Settled or released by this object."""
        return self.settlement is not None or self.released

    async def settle(
        self, *, input_tokens: int, output_tokens: int, outcome: Outcome = "ok"
    ) -> Settlement:
        """Charge what the provider reported; refund (or debit) the difference."""
        self.settlement = await self._limiter.settle(
            self.reservation_id,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            outcome=outcome,
        )
        return self.settlement

    async def release(self) -> None:
        """Give everything back: the provider was never called."""
        await self._limiter.release(self.reservation_id)
        self.released = True

    async def heartbeat(self, lease_seconds: int | None = None) -> datetime:
        """Extend the lease while the work is healthy."""
        result = await self._limiter.heartbeat(self.reservation_id, lease_seconds=lease_seconds)
        assert result.lease_expires_at is not None
        self.lease_expires_at = result.lease_expires_at
        return self.lease_expires_at
