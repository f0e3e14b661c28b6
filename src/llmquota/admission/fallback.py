"""What a worker decides on its own while the store cannot answer in time.

Each layer's failure mode, read from the worker's cached policies, decides
for that layer, and a request passes every layer that limits it:

- a `closed` layer refuses (the caller gets StoreUnavailable, a 503, never a
  429: an outage must not look like a tenant over its limit);
- a `local` layer admits against its worker-local bucket (a fraction of its
  limits, see local_bucket.py), all such layers or none; a `local` decision
  also passes a local bucket of each provider ceiling the model matches, and
  a fraction of what each blocking quota and the prepaid balance had left
  when the worker last looked (local_budget.py), so a tenant out of credit
  or quota is refused (402, 429) rather than served for free;
- an `open` layer lets the request through.

No cached policy (an unknown tenant, or a copy past its expiry) counts as
closed. What is admitted goes into the outage journal before the caller
hears yes; settles and releases of journaled reservations are journaled too.
The Limiter calls this only after the store failed, counts the outcome in
its metrics, and records the journal when the store is back.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from llmquota.admission.outage import JournalFull, OutageEntry, OutageJournal
from llmquota.admission.policy_cache import LayerKey, PolicyCache
from llmquota.domain.errors import ReservationConflict, ReservationNotFound
from llmquota.domain.local_bucket import NEVER_MS, LocalLayer, admit_locally, give_back_locally
from llmquota.domain.local_budget import BudgetHold, BudgetRefusal, CeilingFigures, LocalBudgets
from llmquota.domain.outage_ids import is_signed_outage_id, new_outage_id
from llmquota.domain.policy import CallWeight, call_weight
from llmquota.domain.records import (
    AdmitDecision,
    AdmitRequest,
    CachedLayer,
    FinishRequest,
    FinishResult,
    HeartbeatResult,
    TenantFigures,
)
from llmquota.domain.vocabulary import AdmitStatus, FailureMode, FinishStatus, LimitKind, Scope


@dataclass(frozen=True, slots=True)
class FallbackDecision:
    """The failure mode that decided, and its decision (None: closed, refuse with 503)."""

    mode: FailureMode
    decision: AdmitDecision | None
    reason: str = ""


class Fallback:
    """One worker's decisions while the store is away."""

    def __init__(
        self,
        policies: PolicyCache,
        journal: OutageJournal,
        local_fraction: float,
        concurrency_retry_ms: int,
        cell: int | None = None,
    ) -> None:
        self.policies = policies
        self.cell = cell  # the cell its ids hint at (domain/cell_hints.py), if any
        self.journal = journal
        self.local_fraction = local_fraction
        self.concurrency_retry_ms = concurrency_retry_ms
        # Worker-local limits of `local` layers, with the policy version they copy.
        self._local: dict[LayerKey, tuple[int, LocalLayer]] = {}
        # Worker-local buckets of provider ceilings, by name, with their version.
        self._ceilings: dict[str, tuple[int, LocalLayer]] = {}
        # The local layers each locally admitted reservation holds, and what it took.
        self._holds: dict[uuid.UUID, tuple[list[LocalLayer], CallWeight]] = {}
        # What local admissions took of the last-known quotas and balances.
        self.budgets = LocalBudgets(local_fraction)
        # The key this worker signs its outage ids with, loaded from the store
        # with the policies; without it the worker admits nothing on its own.
        self.id_key: bytes | None = None

    def made_by_a_worker(self, reservation_id: uuid.UUID) -> bool:
        """Whether some worker signed this outage id (True while the key is unknown:
        without the key, a real id must not be called made up)."""
        return self.id_key is None or is_signed_outage_id(reservation_id, self.id_key)

    def decide(self, request: AdmitRequest, now: float) -> FallbackDecision:
        """Decide by the failure modes of the request's layers, from the cached policies."""
        layers = self.policies.layers_for(request.tenant, request.route)
        if layers is None or not self.policies.usable(now):
            return FallbackDecision("closed", None, "no current cached policy for this tenant")
        limiting = [layer for layer in layers if layer.policy.has_limits]
        if any(layer.policy.failure_mode == "closed" for layer in limiting):
            return FallbackDecision("closed", None, "failure mode is closed")
        local = [layer for layer in limiting if layer.policy.failure_mode == "local"]
        mode: FailureMode = "local" if local else "open"
        if request.idempotency_key is not None:
            prior = self.journal.by_idempotency_key(request.tenant, request.idempotency_key)
            if prior is not None:
                return FallbackDecision(mode, _replay(request, prior))
        cost = request.input_tokens + request.max_tokens
        figures = _figures(layers)
        too_large = _too_large(limiting, cost)
        if too_large is not None:
            return FallbackDecision(
                mode,
                _decision(
                    "too_large",
                    figures,
                    reserved_tokens=cost,
                    limit_kind="tokens",
                    limit_scope=too_large.scope,
                    capacity=too_large.policy.effective_token_burst,
                ),
            )
        weight = call_weight({layer.scope: layer.policy for layer in layers})
        taken = self._take_local(request, mode, local, figures, now, weight=weight)
        if isinstance(taken, FallbackDecision):
            return taken
        local_layers, hold = taken
        return self._journal_admission(
            request, mode, layers, (local_layers, weight), now, hold=hold
        )

    def _take_local(
        self,
        request: AdmitRequest,
        mode: FailureMode,
        local: Sequence[CachedLayer],
        figures: TenantFigures,
        now: float,
        *,
        weight: CallWeight,
    ) -> FallbackDecision | tuple[list[LocalLayer], BudgetHold | None]:
        """Take the request's share of each `local` layer and, for a `local`
        decision, of each ceiling, quota and prepaid balance: all or nothing.
        The refusal, or the local layers held and the budgets to hold."""
        cost = request.input_tokens + request.max_tokens
        budgets = self.policies.budgets
        local_layers = [self._local_layer(layer, now) for layer in local] + [
            self._ceiling_layer(ceiling, now)
            for ceiling in (budgets.ceilings_for(request.model) if local else ())
        ]
        refusal = admit_locally(local_layers, cost, now, self.concurrency_retry_ms, weight)
        if refusal is not None:
            return FallbackDecision(
                mode,
                _decision(
                    "rate_limited",
                    figures,
                    reserved_tokens=cost,
                    limit_kind=refusal.limit,
                    limit_scope=refusal.scope,
                    retry_after_ms=refusal.retry_after_ms,
                ),
            )
        if not local:
            return local_layers, None
        hold = self.budgets.admit(
            budgets,
            tenant=request.tenant,
            route=request.route,
            model=request.model,
            input_tokens=request.input_tokens,
            max_tokens=request.max_tokens,
            prepaid=request.tenant in budgets.credits,
            now=datetime.now(UTC),
        )
        if isinstance(hold, BudgetRefusal):
            give_back_locally(local_layers, cost, weight.requests, now, weight.permits)
            return FallbackDecision(mode, _budget_refusal(hold, request, figures))
        return local_layers, hold

    def _journal_admission(
        self,
        request: AdmitRequest,
        mode: FailureMode,
        layers: Sequence[CachedLayer],
        held: tuple[list[LocalLayer], CallWeight],
        now: float,
        *,
        hold: BudgetHold | None,
    ) -> FallbackDecision:
        """Admit a request that passed every layer: journal it before saying yes."""
        cost = request.input_tokens + request.max_tokens
        local_layers, weight = held
        if self.id_key is None:
            give_back_locally(local_layers, cost, weight.requests, now, weight.permits)
            return FallbackDecision("closed", None, "no outage id key loaded yet")
        entry = OutageEntry(
            reservation_id=new_outage_id(self.id_key, self.cell),
            request=request,
            mode=mode,
            policy_version=max(layer.policy_version for layer in layers),
            admitted_at=datetime.now(UTC),
        )
        try:
            self.journal.add(entry)
        except JournalFull as exc:
            # It could not be counted, so it is not admitted.
            give_back_locally(local_layers, cost, weight.requests, now, weight.permits)
            return FallbackDecision("closed", None, str(exc))
        if local_layers:
            self._holds[entry.reservation_id] = held
        if hold is not None:
            self.budgets.hold(entry.reservation_id, hold)
        lease = request.lease_seconds or layers[-1].policy.lease_seconds
        return FallbackDecision(
            mode,
            _decision(
                "admitted",
                _figures(layers),
                reservation_id=entry.reservation_id,
                reserved_tokens=cost,
                # The lease starts on the database clock when the store records
                # the reservation; until then this is the worker's estimate.
                lease_expires_at=datetime.now(UTC) + timedelta(seconds=lease),
                lease_generation=1,
                remaining=_local_remaining(local_layers),
            ),
        )

    def finish(self, request: FinishRequest, now: float) -> FinishResult | None:
        """Settle or release a reservation still in the outage journal; None if it is not.

        Synchronous on purpose: between looking the entry up and journaling
        the finish there is no await, so a flush cannot forget it midway.
        """
        entry = self.journal.get(request.reservation_id)
        if entry is None:
            return None  # recorded already (or never ours): the store has it
        if request.caller is not None and request.caller != entry.tenant:
            raise ReservationNotFound(f"no reservation {request.reservation_id}")
        result = _journal_finish(entry, request)
        if result.status in ("settled", "released"):
            self.journal.set_finish(entry, request, datetime.now(UTC))
            self._budgets_finish(entry, request)
            held = self._holds.pop(entry.reservation_id, None)
            if held:
                local_layers, weight = held
                if request.action == "release":
                    credit, requests = float(entry.reserved_tokens), float(weight.requests)
                else:
                    credit = float(entry.reserved_tokens - (result.charged_tokens or 0))
                    requests = 0.0
                give_back_locally(local_layers, credit, requests, now, weight.permits)
        return result

    def heartbeat(
        self, reservation_id: uuid.UUID, caller: str | None, lease_seconds: int | None
    ) -> HeartbeatResult | None:
        """Answer a heartbeat for a journaled reservation; None if it is not journaled."""
        entry = self.journal.get(reservation_id)
        if entry is None:
            return None
        if caller is not None and caller != entry.tenant:
            raise ReservationNotFound(f"no reservation {entry.reservation_id}")
        if entry.finish is not None:
            state = "released" if entry.finish.action == "release" else "settled"
            raise ReservationConflict(
                f"reservation is {state}; its lease cannot be extended", state=state
            )
        lease = lease_seconds or entry.request.lease_seconds or 120
        return HeartbeatResult(
            state="active",
            lease_expires_at=datetime.now(UTC) + timedelta(seconds=lease),
            lease_generation=1,
            lease_live=True,
            current_generation=1,
        )

    def recorded(self, entries: Sequence[OutageEntry], now: float) -> None:
        """The store holds these now, permits included: the local copies let go."""
        for entry in entries:
            held = self._holds.pop(entry.reservation_id, None)
            if held:
                give_back_locally(held[0], 0.0, 0.0, now, held[1].permits)
            self.budgets.recorded(entry.reservation_id)

    def _budgets_finish(self, entry: OutageEntry, request: FinishRequest) -> None:
        """A settle holds what was used (priced as last known); a release nothing."""
        if request.action == "release":
            self.budgets.finish(entry.reservation_id, 0, Decimal(0))
            return
        input_tokens = int(request.input_tokens or 0)
        output_tokens = int(request.output_tokens or 0)
        money = self.policies.budgets.cost(entry.request.model, input_tokens, output_tokens)
        self.budgets.finish(entry.reservation_id, input_tokens + output_tokens, money or Decimal(0))

    def _ceiling_layer(self, ceiling: CeilingFigures, now: float) -> LocalLayer:
        held = self._ceilings.get(ceiling.ceiling)
        if held is None or held[0] != ceiling.policy_version:
            local = LocalLayer.from_policy("ceiling", ceiling.policy, self.local_fraction, now)
            held = (ceiling.policy_version, local)
            self._ceilings[ceiling.ceiling] = held
        return held[1]

    def _local_layer(self, layer: CachedLayer, now: float) -> LocalLayer:
        key: LayerKey = (layer.scope, layer.tenant, layer.route)
        held = self._local.get(key)
        if held is None or held[0] != layer.policy_version:
            local = LocalLayer.from_policy(layer.scope, layer.policy, self.local_fraction, now)
            held = (layer.policy_version, local)
            self._local[key] = held
        return held[1]


def _too_large(layers: Sequence[CachedLayer], cost: int) -> CachedLayer | None:
    """The layer with the smallest token capacity that `cost` exceeds, if any."""
    return min(
        (
            layer
            for layer in layers
            if layer.policy.effective_token_burst is not None
            and cost > layer.policy.effective_token_burst
        ),
        key=lambda layer: layer.policy.effective_token_burst or 0,
        default=None,
    )


def _budget_refusal(
    refusal: BudgetRefusal, request: AdmitRequest, figures: TenantFigures
) -> AdmitDecision:
    """A quota used up or a balance short, as lq_admit would answer it."""
    cost = request.input_tokens + request.max_tokens
    if refusal.kind == "quota_exceeded" and refusal.quota is not None:
        quota = refusal.quota
        wait = (quota.window_end - datetime.now(UTC)).total_seconds() * 1000
        return _decision(
            "quota_exceeded",
            figures,
            reserved_tokens=cost,
            limit_kind="quota",
            limit_scope="route" if quota.route is not None else "tenant",
            retry_after_ms=min(NEVER_MS, max(1, math.ceil(wait))),
        )._replace(quota=quota.name, resets_at=quota.window_end, model=request.model)
    if refusal.kind == "credits_exhausted":
        return _decision(
            "credits_exhausted", figures, reserved_tokens=cost, limit_kind="credits"
        )._replace(credit_balance=refusal.available, model=request.model)
    return _decision("unpriced_model", figures, reserved_tokens=cost)._replace(model=request.model)


def _replay(request: AdmitRequest, prior: OutageEntry) -> AdmitDecision:
    """A repeated idempotency key during the outage: the same reservation, or a conflict."""
    if prior.request.request_hash != request.request_hash:
        return _decision("idempotency_conflict", _figures([]))
    return _decision(
        "replayed",
        _figures([]),
        reservation_id=prior.reservation_id,
        reserved_tokens=prior.reserved_tokens,
        lease_expires_at=datetime.now(UTC),
        lease_generation=1,
    )


def _figures(layers: Sequence[CachedLayer]) -> TenantFigures:
    """The tenant layer's policy for headers; balances are unknown offline."""
    tenant = next((layer for layer in layers if layer.scope == "tenant"), None)
    policy = tenant.policy.resolved() if tenant is not None else None
    return TenantFigures(
        tokens_per_minute=policy.tokens_per_minute if policy else None,
        token_burst=policy.token_burst if policy else None,
        tokens=None,
        requests_per_minute=policy.requests_per_minute if policy else None,
        request_burst=policy.request_burst if policy else None,
        requests=None,
    )


def _local_remaining(layers: Sequence[LocalLayer]) -> tuple[int | None, int | None, int | None]:
    tokens = [math.floor(x.tokens.balance) for x in layers if x.tokens is not None]
    requests = [math.floor(x.requests.balance) for x in layers if x.requests is not None]
    permits = [x.max_in_flight - x.in_flight for x in layers if x.max_in_flight is not None]
    return (
        min(tokens) if tokens else None,
        min(requests) if requests else None,
        min(permits) if permits else None,
    )


def _decision(
    status: AdmitStatus,
    tenant: TenantFigures,
    *,
    reservation_id: uuid.UUID | None = None,
    reserved_tokens: int | None = None,
    lease_expires_at: datetime | None = None,
    lease_generation: int | None = None,
    limit_kind: LimitKind | None = None,
    limit_scope: Scope | None = None,
    retry_after_ms: int | None = None,
    capacity: int | None = None,
    remaining: tuple[int | None, int | None, int | None] = (None, None, None),
) -> AdmitDecision:
    return AdmitDecision(
        status=status,
        reservation_id=reservation_id,
        reserved_tokens=reserved_tokens,
        lease_expires_at=lease_expires_at,
        lease_generation=lease_generation,
        limit_kind=limit_kind,
        limit_scope=limit_scope,
        retry_after_ms=retry_after_ms,
        capacity=capacity,
        remaining_tokens=remaining[0],
        remaining_requests=remaining[1],
        remaining_in_flight=remaining[2],
        tenant=tenant,
    )


def _journal_finish(entry: OutageEntry, request: FinishRequest) -> FinishResult:
    """What lq_finish will answer for this journaled reservation, decided now.

    The store records the reservation with a fresh lease just before it
    replays this settle, so an on-time settle is what it will see.
    """
    prior = entry.finish
    reserved = entry.reserved_tokens
    status: FinishStatus
    if prior is None:
        if request.action == "release":
            return FinishResult("released", "released", entry.tenant, None, None, False)
        charged = int(request.input_tokens or 0) + int(request.output_tokens or 0)
        refunded = max(reserved - charged, 0)
        return FinishResult("settled", "settled", entry.tenant, charged, refunded, False)
    if prior.action == "release":
        status = "replayed" if request.action == "release" else "conflict"
        return FinishResult(status, "released", entry.tenant, None, None, False)
    charged = int(prior.input_tokens or 0) + int(prior.output_tokens or 0)
    same = (prior.input_tokens, prior.output_tokens, prior.outcome) == (
        request.input_tokens,
        request.output_tokens,
        request.outcome,
    )
    status = "replayed" if request.action == "settle" and same else "conflict"
    return FinishResult(status, "settled", entry.tenant, charged, max(reserved - charged, 0), False)
