"""llmquota: admission control for LLM providers on PostgreSQL.

Reserve before the request leaves, settle with what it really cost, and keep
every tenant inside its token, request and concurrency limits.
"""

from llmquota.config import Settings
from llmquota.errors import (
    IdempotencyConflict,
    InvalidRequest,
    LimiterError,
    RateLimited,
    RequestTooLarge,
    ReservationConflict,
    ReservationNotFound,
    StoreUnavailable,
    UnknownTenant,
)
from llmquota.limiter import Limiter, Reservation, Settlement, SweepReport
from llmquota.policy import Policy

__all__ = [
    "IdempotencyConflict",
    "InvalidRequest",
    "Limiter",
    "LimiterError",
    "Policy",
    "RateLimited",
    "RequestTooLarge",
    "Reservation",
    "ReservationConflict",
    "ReservationNotFound",
    "Settings",
    "Settlement",
    "StoreUnavailable",
    "SweepReport",
    "UnknownTenant",
]
