"""The exceptions a REST answer turns into: the library's own, and four of HTTP's.

A refusal over the API raises the very class the library raises for it
(llmquota.domain.errors), with the same fields, so one `except RateLimited`
serves a caller whichever way it reaches the limiter. Only what the library
cannot meet gets a class of its own here: a key the server refuses (401,
403), a server that cannot be reached, and an answer that is not llmquota's.
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal, InvalidOperation
from typing import Any, cast

from llmquota.client.wire import Answer
from llmquota.domain.errors import (
    CreditsExhausted,
    IdempotencyConflict,
    InvalidRequest,
    LimiterError,
    QuotaExceeded,
    RateLimited,
    RequestTooLarge,
    ReservationConflict,
    StoreUnavailable,
    UnpricedModel,
)
from llmquota.domain.vocabulary import LimitKind, Scope


class AuthenticationFailed(LimiterError):
    """401: the key is missing, unknown, expired or revoked (the server never says which)."""


class PermissionDenied(LimiterError):
    """403: the key may not do this (another tenant, a missing scope), or its tenant is
    suspended (`error_type` "tenant_suspended")."""

    def __init__(self, message: str, error_type: str | None) -> None:
        super().__init__(message)
        self.error_type = error_type


class LimiterUnreachable(StoreUnavailable):
    """The server could not be reached (or did not answer) after every retry.

    A StoreUnavailable, so code written for the library's outage answer
    handles the service's too; the transport error is the `__cause__`.
    """


class UnexpectedResponse(LimiterError):
    """An answer not in llmquota's error shape (a proxy in between, a wrong base URL)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


def error_of(answer: Answer, not_found: type[LimiterError]) -> LimiterError:
    """The exception an error answer stands for.

    `not_found` is what a 404 means where it was asked: UnknownTenant for an
    admission, ReservationNotFound for a reservation's settle, release or
    heartbeat.
    """
    error = answer.error
    if error is None:
        return UnexpectedResponse(answer.status, answer.text[:200])
    message = str(error.get("message") or f"HTTP {answer.status}")
    kind = error.get("type")
    if answer.status == 429:
        return _rate_limited(error, message)
    if answer.status == 413 and kind == "request_too_large":
        return RequestTooLarge(
            scope=cast(Scope, error.get("scope")),
            requested=int(error.get("requested") or 0),
            capacity=int(error.get("capacity") or 0),
            message=message,
            limit="requests" if error.get("limit") == "requests" else "tokens",
        )
    if answer.status == 402:
        return CreditsExhausted(balance=_decimal(error.get("balance")), message=message)
    if answer.status == 422:
        if kind == "idempotency_conflict":
            return IdempotencyConflict(message)
        return UnpricedModel(message) if "model" in error else InvalidRequest(message)
    return _by_status(answer.status, kind, error, message, not_found)


def _rate_limited(error: dict[str, Any], message: str) -> RateLimited:
    """A 429: a calendar quota used up (QuotaExceeded), or a limit out of room."""
    retry_after_ms = int(error.get("retry_after_ms") or 0)
    scope = cast(Scope, error.get("scope"))
    resets_at = error.get("resets_at")
    if error.get("type") == "insufficient_quota" and isinstance(resets_at, str):
        return QuotaExceeded(
            quota=str(error.get("quota")),
            scope=scope,
            resets_at=datetime.fromisoformat(resets_at),
            retry_after_ms=retry_after_ms,
            message=message,
        )
    limit = cast(LimitKind, error.get("limit"))
    return RateLimited(limit=limit, scope=scope, retry_after_ms=retry_after_ms, message=message)


def _by_status(
    status: int,
    kind: object,
    error: dict[str, Any],
    message: str,
    not_found: type[LimiterError],
) -> LimiterError:
    """The errors whose status alone says what they are."""
    if status == 404:
        return not_found(message)
    if status == 409:
        state = error.get("state")
        return ReservationConflict(message, state=state if isinstance(state, str) else None)
    if status == 401:
        return AuthenticationFailed(message)
    if status == 403:
        return PermissionDenied(message, kind if isinstance(kind, str) else None)
    if status == 503:
        return StoreUnavailable(message)
    if status in (400, 413, 415):
        return InvalidRequest(message)
    return UnexpectedResponse(status, message)


def _decimal(value: object) -> Decimal:
    """A money figure of the API (a decimal string); 0 when it is not one."""
    try:
        return Decimal(str(value))
    except InvalidOperation:
        return Decimal(0)
