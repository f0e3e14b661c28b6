"""Tokens reserved and charged, by model and plan, in the metrics.

The admission decision names the model admitted (a fallback when degraded)
and the tenant's plan, and so does the settlement statement (lq_finish
answers the reservation's model and its tenant's plan). This worker
remembers the labels of the reservations it admitted, in a bounded map, and
charges a settlement to them, the labels its reserved tokens were counted
under; a reservation admitted by another worker (or forgotten past
MAX_REMEMBERED) is charged to the labels the store answered, and only a
settlement the store did not answer (a worker's own, during an outage) as
"unknown". The ledger, not these counters, is the record for billing: this
is a view for dashboards, and must never cost a round trip.
"""

from __future__ import annotations

import logging
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from llmquota.admission.reservation import Settlement
from llmquota.domain.records import AdmitDecision, FinishResult
from llmquota.domain.vocabulary import Scope
from llmquota.metrics import Metrics

if TYPE_CHECKING:
    from prometheus_client import Counter

log = logging.getLogger(__name__)

# Reservations whose labels a worker remembers until they settle; the oldest
# are forgotten first (a lease that expired is never settled here).
MAX_REMEMBERED = 50_000
UNKNOWN = "unknown"
# (model, plan) pairs whose metric children are kept bound; past it the rest
# are looked up each time, as before.
MAX_BOUND = 1_024


class TokenAccounting:
    """Counts each store decision, and reserved and charged tokens by model and plan."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self._labels: OrderedDict[uuid.UUID, tuple[str, str]] = OrderedDict()
        # (model, plan) as decided -> their bounded labels and the reserved
        # tokens counter bound to them: one dict lookup per admission instead
        # of two label mappings and a labels() call.
        self._reserved: dict[tuple[str | None, str | None], tuple[tuple[str, str], Counter]] = {}

    def decided(self, results: Sequence[AdmitDecision | Exception]) -> None:
        """A batch's decisions of the store (a waiter's re-decisions each count).

        Counted per batch: one increment of admits and of each (model, plan)
        pair's reserved tokens, not one per decision (each is a locked update).
        An admission whose caller left before it arrived counts too: it was
        granted, and its release is counted as one.
        """
        admitted = 0
        reserved: dict[Counter, int] = {}
        remembered = self._labels
        for decision in results:
            if isinstance(decision, Exception):
                continue  # refused data: that request's error, no decision
            if decision.status != "admitted":
                self.metrics.count_decision(decision)
                continue
            admitted += 1
            if decision.reservation_id is None:
                continue
            key = (decision.model, decision.plan)
            labels, counter = self._reserved.get(key) or self._bind(key)
            reserved[counter] = reserved.get(counter, 0) + int(decision.reserved_tokens or 0)
            remembered[decision.reservation_id] = labels
        if admitted:
            self.metrics.admits.inc(admitted)
        for counter, tokens in reserved.items():
            counter.inc(tokens)
        while len(remembered) > MAX_REMEMBERED:
            remembered.popitem(last=False)

    def _bind(self, key: tuple[str | None, str | None]) -> tuple[tuple[str, str], Counter]:
        """The labels of a (model, plan) and its reserved tokens counter, cached
        for at most MAX_BOUND pairs (models are what clients name)."""
        labels = (self.metrics.model_labels(key[0]), self.metrics.plan_labels(key[1]))
        bound = (labels, self.metrics.reserved_tokens.labels(*labels))
        if len(self._reserved) < MAX_BOUND:
            self._reserved[key] = bound
        return bound

    def released(self, reservation_id: uuid.UUID) -> None:
        self.metrics.releases.inc()
        self._labels.pop(reservation_id, None)

    def settled(
        self, reservation_id: uuid.UUID, result: FinishResult, settlement: Settlement
    ) -> None:
        """Count a settlement: charged by its labels, refunds, and usage beyond reason."""
        labels = self._labels.pop(reservation_id, None)
        if labels is None:  # admitted by another worker: the store's labels
            labels = (
                (self.metrics.model_labels(result.model), self.metrics.plan_labels(result.plan))
                if result.model is not None
                else (UNKNOWN, UNKNOWN)
            )
        self.metrics.charged_tokens.labels(*labels).inc(settlement.charged_tokens)
        self.metrics.settlements.labels(str(settlement.late).lower()).inc()
        self.metrics.refunded_tokens.inc(settlement.refunded_tokens)
        self._forgiven(reservation_id, result)
        if settlement.excess_tokens:
            self.metrics.excess_settlements.inc()
            self.metrics.excess_tokens.inc(settlement.excess_tokens)
            log.warning(
                "reservation %s of tenant %s settled %d tokens above its possible "
                "maximum; shared layers were charged the maximum only",
                reservation_id,
                result.tenant,
                settlement.excess_tokens,
            )

    def _forgiven(self, reservation_id: uuid.UUID, result: FinishResult) -> None:
        """Count what shared layers forgave at their floor (minus their burst), by scope."""
        forgiven: tuple[tuple[Scope, int | None], ...] = (
            ("global", result.forgiven_global_tokens),
            ("ceiling", result.forgiven_ceiling_tokens),
        )
        for scope, tokens in forgiven:
            if tokens:
                self.metrics.shared_debt_forgiven_tokens.labels(scope).inc(tokens)
                log.warning(
                    "reservation %s of tenant %s: the %s layer stood at minus its burst and "
                    "was not debited %d of its usage (charged to the tenant, in the ledger)",
                    reservation_id,
                    result.tenant,
                    scope,
                    tokens,
                )
