"""Refusals a worker answers from memory while they still hold.

A tenant flooding past its limit would otherwise cost one statement per
request: a round trip, row locks on its layers and a commit, each taken
from the connections and the CPU the quiet tenants share. Once a request
is refused as rate limited, this worker refuses the tenant's same request
again (the same route, model, priority, fallbacks and token counts) from
memory, with the same answer and its retry hint counted down, until the
first of:

- the refusal's retry hint (before it, the store would refuse it too);
- MEMORY_SECONDS after it was decided;
- a settle or release of that tenant finished by this worker, which may
  have given back what the refusal lacked;
- a policy change announced to this worker (changes.py);
- room moved into the cell by this process's rebalancer (rebalancer.py).

Only the same request: a smaller one may fit, and a larger one may get
another answer altogether (too large for some layer's burst, a 413), which
only the store knows.

A settlement in another worker, a sweep, or another process's rebalancer
can make room earlier without this worker knowing: a request refused from
memory in that moment is wrongly refused, for at most MEMORY_SECONDS
(100 ms) after the room was made. Requests with an idempotency key are never answered from memory (a
retry of an admitted key must get its admission back), nor are waiters'
decisions (waiting.py decides again at the hint, which is past any entry).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from llmquota.domain.records import AdmitDecision, AdmitRequest, FinishResult

# The longest a refusal is answered from memory (LLMQUOTA_REFUSAL_MEMORY_MS,
# at most this): the bound on how long one can be wrong after another worker
# made room.
MEMORY_SECONDS = 0.1
# Tenants kept per worker; past it, the one remembered longest ago goes first.
MAX_TENANTS = 10_000

# What two requests of one tenant must share for one's refusal to stand for
# the other's: everything the store decides by, which is the request less
# what only names it (its idempotency key and digest) or only matters once
# admitted (its lease, and the serving path its reservation journals).
RefusalShape = AdmitRequest


@dataclass(frozen=True, slots=True)
class _Remembered:
    decision: AdmitDecision
    decided_at: float
    until: float


def _shape(request: AdmitRequest) -> RefusalShape:
    return request._replace(
        idempotency_key=None, request_hash=None, lease_seconds=None, serving_path=None
    )


class RefusalMemory:
    """This worker's recent rate-limit refusals, by tenant and request shape."""

    def __init__(self, memory_seconds: float = MEMORY_SECONDS) -> None:
        self.memory_seconds = memory_seconds
        self._tenants: dict[str, dict[RefusalShape, _Remembered]] = {}

    def __len__(self) -> int:
        return sum(len(shapes) for shapes in self._tenants.values())

    def recall(self, request: AdmitRequest, now: float) -> AdmitDecision | None:
        """The refusal that stands for `request` now, its hint counted down; or None."""
        shapes = self._tenants.get(request.tenant)
        if shapes is None or request.idempotency_key is not None:
            return None
        shape = _shape(request)
        entry = shapes.get(shape)
        if entry is None:
            return None
        if now >= entry.until:
            del shapes[shape]
            if not shapes:
                del self._tenants[request.tenant]
            return None
        waited_ms = round((now - entry.decided_at) * 1000)
        hint = max(1, int(entry.decision.retry_after_ms or 0) - waited_ms)
        return entry.decision._replace(retry_after_ms=hint)

    def remember(self, request: AdmitRequest, decision: AdmitDecision, now: float) -> None:
        """Keep a rate-limit refusal the store decided, for the tenant's next requests."""
        hint_ms = decision.retry_after_ms or 0
        if decision.status != "rate_limited" or hint_ms <= 0 or request.idempotency_key:
            return
        if self.memory_seconds <= 0:
            return
        shapes = self._tenants.get(request.tenant)
        if shapes is None:
            if len(self._tenants) >= MAX_TENANTS:
                del self._tenants[next(iter(self._tenants))]
            shapes = self._tenants[request.tenant] = {}
        until = now + min(hint_ms / 1000.0, self.memory_seconds)
        shapes[_shape(request)] = _Remembered(decision, now, until)

    def forget_tenant(self, tenant: str | None) -> None:
        """A reservation of `tenant` was finished here: its refusals may not hold."""
        if tenant is not None:
            self._tenants.pop(tenant, None)

    def forget_finished(self, results: Sequence[FinishResult | Exception]) -> None:
        """Reservations were settled, released or expired here: what they held is
        back, so their tenants' refusals may not hold."""
        for result in results:
            if isinstance(result, FinishResult) and result.status != "not_found":
                self.forget_tenant(result.tenant)

    def forget_all(self) -> None:
        """Policies changed: no refusal is known to hold any more."""
        self._tenants.clear()
