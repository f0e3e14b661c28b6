"""Tokens reserved and charged, by model and plan, in the metrics.

The admission decision names the model admitted (a fallback when degraded)
and the tenant's plan; the settlement statement answers only the tenant. So
this worker remembers the labels of the reservations it admitted, in a
bounded map, and charges a settlement to them; a reservation admitted by
another worker (or forgotten past MAX_REMEMBERED) is charged as "unknown".
The ledger, not these counters, is the record for billing: this is a view
for dashboards, and must never cost a round trip.
"""

from __future__ import annotations

import logging
import uuid
from collections import OrderedDict
from typing import TYPE_CHECKING

from llmquota.admission.reservation import Settlement
from llmquota.domain.records import AdmitDecision, FinishResult
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

    def decided(self, decision: AdmitDecision) -> None:
        """One decision of the store (a waiter's re-decisions each count here)."""
        self.metrics.count_decision(decision)
        if decision.status != "admitted" or decision.reservation_id is None:
            return
        key = (decision.model, decision.plan)
        bound = self._reserved.get(key)
        if bound is None:
            bound = self._bind(key)
        labels, reserved = bound
        reserved.inc(int(decision.reserved_tokens or 0))
        self._labels[decision.reservation_id] = labels
        while len(self._labels) > MAX_REMEMBERED:
            self._labels.popitem(last=False)

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
        model, plan = self._labels.pop(reservation_id, (UNKNOWN, UNKNOWN))
        self.metrics.charged_tokens.labels(model, plan).inc(settlement.charged_tokens)
        self.metrics.settlements.labels(str(settlement.late).lower()).inc()
        self.metrics.refunded_tokens.inc(settlement.refunded_tokens)
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
