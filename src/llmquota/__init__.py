"""llmquota: admission control for LLM providers on PostgreSQL.

Reserve before the request leaves, settle with what it really cost, and keep
every tenant inside its token, request and concurrency limits.
"""

from llmquota.admin.sweeper import SweepReport
from llmquota.admission.heap import settle_after_startup
from llmquota.admission.limiter import Limiter
from llmquota.admission.reservation import Reservation, Settlement
from llmquota.config import Settings
from llmquota.domain.errors import (
    CreditsExhausted,
    IdempotencyConflict,
    InvalidRequest,
    LimiterError,
    QuotaExceeded,
    RateLimited,
    RequestTooLarge,
    ReservationConflict,
    ReservationNotFound,
    StoreUnavailable,
    TenantSuspended,
    UnknownTenant,
    UnpricedModel,
)
from llmquota.domain.policy import Policy

__all__ = [
    "CreditsExhausted",
    "IdempotencyConflict",
    "InvalidRequest",
    "Limiter",
    "LimiterError",
    "Policy",
    "QuotaExceeded",
    "RateLimited",
    "RequestTooLarge",
    "Reservation",
    "ReservationConflict",
    "ReservationNotFound",
    "Settings",
    "Settlement",
    "StoreUnavailable",
    "SweepReport",
    "TenantSuspended",
    "UnknownTenant",
    "UnpricedModel",
    "settle_after_startup",
]
