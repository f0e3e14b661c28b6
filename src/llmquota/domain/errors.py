"""The errors a caller of llmquota can get, as types.

Each refusal says what bound it and what to do: wait (RateLimited, with a
retry hint), change the request (RequestTooLarge, never retryable), or fix a
mistake (the rest).
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal

from llmquota.domain.vocabulary import LimitKind, Scope


class LimiterError(Exception):
    """Base class of every error llmquota raises on purpose."""


class RateLimited(LimiterError):
    """A limit has no room now; retrying after `retry_after_ms` may succeed."""

    def __init__(self, limit: LimitKind, scope: Scope, retry_after_ms: int, message: str) -> None:
        super().__init__(message)
        self.limit = limit
        self.scope = scope
        self.retry_after_ms = retry_after_ms
        self.message = message

    @property
    def retry_after(self) -> float:
        """The retry hint in seconds."""
        return self.retry_after_ms / 1000.0


class QuotaExceeded(RateLimited):
    """A calendar quota is used up; it resets at `resets_at` (the window's end)."""

    def __init__(
        self, quota: str, scope: Scope, resets_at: datetime, retry_after_ms: int, message: str
    ) -> None:
        super().__init__("quota", scope, retry_after_ms, message)
        self.quota = quota
        self.resets_at = resets_at


class CreditsExhausted(LimiterError):
    """A prepaid balance cannot cover the request's maximum cost; retry after a top-up."""

    def __init__(self, balance: Decimal, message: str) -> None:
        super().__init__(message)
        self.balance = balance


class RequestTooLarge(LimiterError):
    """The reservation exceeds a layer's token capacity (or the request's weighted
    cost its request capacity, `limit` "requests"): it can never fit."""

    def __init__(
        self,
        scope: Scope,
        requested: int,
        capacity: int,
        message: str,
        limit: LimitKind = "tokens",
    ) -> None:
        super().__init__(message)
        self.limit = limit
        self.scope = scope
        self.requested = requested
        self.capacity = capacity
        self.message = message


class UnknownTenant(LimiterError):
    """No such tenant is registered."""


class TenantSuspended(LimiterError):
    """The tenant is suspended: no new admissions, whoever asks (403 tenant_suspended);
    what it holds still settles, releases and heartbeats."""


class UnknownName(LimiterError):
    """No plan, ceiling or other named object of that name."""


class NameInUse(LimiterError):
    """The named object is still in use (a plan with tenants on it)."""


class TenantBusy(NameInUse):
    """A tenant cannot be deleted while it has active reservations."""

    def __init__(self, message: str, active_reservations: int) -> None:
        super().__init__(message)
        self.active_reservations = active_reservations


class UnknownReport(LimiterError):
    """No report function of that name (that this database role may run)."""


class PreconditionFailed(LimiterError):
    """An If-Match precondition did not hold: the resource changed (or is gone) since."""


class InvalidRequest(LimiterError):
    """The request's values are out of range or of the wrong kind."""


class UnsupportedMediaType(InvalidRequest):
    """A body in a content-type the endpoint does not read (a PATCH not a merge patch)."""


class UnpricedModel(InvalidRequest):
    """A cost quota or a prepaid balance applies and the model has no price: never free."""


class RefusedValue(InvalidRequest):
    """The database refused a value the request carries, though our checks passed it.

    Tied to one request's data (SQLSTATE class 22), never to the database's
    health: the limiter decides the rest of a batch without that request.
    """


class ReservationNotFound(LimiterError):
    """No such reservation, or it belongs to another tenant."""


class ReservationConflict(LimiterError):
    """The reservation is in a state that does not allow this action."""

    def __init__(self, message: str, state: str | None = None) -> None:
        super().__init__(message)
        self.state = state


class IdempotencyConflict(LimiterError):
    """The idempotency key was used before for a different request."""


class StoreUnavailable(LimiterError):
    """The database could not be reached or did not answer in time; retryable."""


class StoreTimeout(StoreUnavailable):
    """The database did not answer within the decision deadline."""
