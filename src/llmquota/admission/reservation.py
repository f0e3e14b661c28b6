"""What an admission gives the caller: the decision, and the reservation it holds.

An Admission is the store's (or the failure mode's) answer with what was
counted to reach it; refusals stay data until a caller asks for them as
exceptions. A Reservation is the one handle a caller settles, releases or
heartbeats, the library's callers and the proxy alike; it only forwards to
the Limiter, which owns every transition. What differs for the proxy is
asked for by name: a fenced lease (`fence`), figures an upstream reported
(`settle_upstream`, journaled when the store is away) and the mark that its
output was relayed (`heartbeat(relayed=True)`).
"""

from __future__ import annotations

import asyncio
import functools
import uuid
from datetime import datetime
from typing import TYPE_CHECKING, NamedTuple

from llmquota.domain.errors import (
    IdempotencyConflict,
    ReservationConflict,
    UnknownTenant,
)
from llmquota.domain.output_estimates import OutputEstimateInfo, OutputStrategy
from llmquota.domain.records import AdmitDecision, HeartbeatResult
from llmquota.domain.refusal_table import REFUSALS
from llmquota.domain.settlement import Settlement
from llmquota.domain.upstream_usage import UpstreamUsage
from llmquota.domain.vocabulary import FailureMode, Outcome, SettledPath

if TYPE_CHECKING:
    from llmquota.admission.limiter import Limiter

# Settlement is re-exported: it lives in the domain so that the REST client
# (llmquota.client) returns the same type.
__all__ = ["Admission", "Reservation", "Settlement", "heartbeat_refusal", "unknown_tenant"]


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
        rule = REFUSALS.get(d.status)
        error = rule.error(tenant, d) if rule is not None else None
        if error is not None:
            raise error
        if d.status == "unknown_tenant":
            raise unknown_tenant(tenant)
        if d.status == "idempotency_conflict":
            raise IdempotencyConflict(
                "idempotency_key was already used for a different request by this tenant"
            )
        # lq_admit names the limit and scope of every refusal; a row without
        # them is a broken contract, not a caller's mistake.
        raise RuntimeError(f"refusal {d.status!r} without the limit that bound it")


def unknown_tenant(tenant: str) -> UnknownTenant:
    """The error for a tenant the store has no tenant layer of (admission's unknown_tenant)."""
    return UnknownTenant(f"unknown tenant {tenant!r}")


def heartbeat_refusal(result: HeartbeatResult, lease_generation: int | None) -> ReservationConflict:
    """Why a heartbeat the store answered extended nothing (no new expiry)."""
    if (
        result.lease_live
        and lease_generation is not None
        and result.current_generation != lease_generation
    ):
        return ReservationConflict(
            f"stale lease generation {lease_generation}: the lease is at generation "
            f"{result.current_generation}; another holder extended it",
            state=result.state,
        )
    # 'active' here means the lease ran out, or a settle won the race.
    state = (
        "no longer active (its lease ran out, or it was just settled)"
        if result.state == "active"
        else result.state
    )
    return ReservationConflict(
        f"reservation is {state}; its lease cannot be extended", state=result.state
    )


class Reservation:
    """Admitted capacity held until settled, released or expired.

    `fence`: heartbeats carry the lease generation this handle last saw, so a
    holder paused while another extended the lease is refused (the proxy's
    streams heartbeat from a task of their own). Off for the library, whose
    callers may extend a lease by id as well.
    """

    def __init__(
        self, limiter: Limiter, tenant: str, admission: Admission, *, fence: bool = False
    ) -> None:
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
        self.decision = d
        # The failure mode that admitted it while the store was away, if one did.
        self.fallback = admission.fallback
        self.lease_generation = d.lease_generation
        self._fence = fence
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
            caller=self.tenant,
        )
        return self.settlement

    async def settle_upstream(
        self,
        usage: UpstreamUsage,
        outcome: Outcome = "ok",
        *,
        serving_path: SettledPath | None = None,
    ) -> Settlement:
        """Settle what an upstream answered (resolved by domain/upstream_usage.py).

        The answer was relayed already, so its usage must land whatever
        happens to the store: a settle the store does not answer is journaled
        and replayed when it is back (Settlement.journaled). The ledger row
        says where the figures came from, with the upstream's own where they
        differ, and how the request was served when `serving_path` names it
        (else as the reservation journaled it).
        """
        self.settlement = await self._limiter.settle(
            self.reservation_id,
            input_tokens=usage.input_tokens,
            output_tokens=usage.output_tokens,
            outcome=outcome,
            caller=self.tenant,
            usage=usage,
            serving_path=serving_path,
        )
        return self.settlement

    async def release(self) -> None:
        """Give everything back: the provider was never called."""
        await self._limiter.release(self.reservation_id, caller=self.tenant)
        self.released = True

    async def release_unless_finished(self) -> None:
        """Release it unless settled or released, shielded (a cancelled caller still
        returns its capacity); one whose lease ran out was returned by its expiry."""
        if self.finished:
            return
        try:
            await asyncio.shield(self._limiter.release(self.reservation_id))
        except ReservationConflict as exc:
            if exc.state != "expired":
                raise
        self.released = True

    async def heartbeat(
        self, lease_seconds: int | None = None, *, relayed: bool = False
    ) -> datetime:
        """Extend the lease while the work is healthy.

        `relayed`: output of it reached the client (the proxy says so once, at
        the first relayed text), remembered by the store for the audit.
        """
        result = await self._limiter.heartbeat(
            self.reservation_id,
            lease_seconds=lease_seconds,
            caller=self.tenant,
            lease_generation=self.lease_generation if self._fence else None,
            relayed=relayed,
        )
        assert result.lease_expires_at is not None
        self.lease_expires_at = result.lease_expires_at
        self.lease_generation = result.lease_generation or self.lease_generation
        return self.lease_expires_at
