"""What an admission would count and reserve now, with nothing decided.

POST /v1/tokens/count answers this for an admit body, so that a client can
size a request (or show its cost) without holding capacity: the request as
Limiter.decide hands it to the store, counted (domain/admit_request.py) and
with the output to reserve under this worker's cached policies and learned
estimates (estimates.py), which is what the admission statement reserves for
the requested model (sql/admission.sql: input plus that output). No
statement decides it, so no bucket, reservation or ledger row changes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmquota.admission.reservation import unknown_tenant
from llmquota.domain.errors import StoreUnavailable
from llmquota.domain.records import AdmitRequest

if TYPE_CHECKING:
    from llmquota.admission.limiter import Limiter


async def count_admission(limiter: Limiter, request: AdmitRequest) -> AdmitRequest:
    """`request` as `limiter` would decide it now: its `reserved_tokens` and
    `output_strategy` are an admission's of the requested model (a fallback it
    degrades to counts its own input and reserves its own output estimate,
    which `request.fallbacks` carry).

    UnknownTenant for a tenant the store does not know, as admission says it.
    While the store does not answer, a tenant in the worker's policy cache is
    counted from it; any other is StoreUnavailable (admission's 503 too, with
    nothing cached).
    """
    try:
        known = await limiter.store.tenant_exists(
            request.tenant, deadline_seconds=limiter.deadline_seconds
        )
    except StoreUnavailable:
        if not limiter.policies.own_layers(request.tenant, None):
            raise
        known = True
    if not known:
        raise unknown_tenant(request.tenant)
    return limiter.estimates.apply(request)
