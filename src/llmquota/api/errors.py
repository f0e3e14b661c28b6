"""The one error shape of the API, and the handlers that render errors in it.

Every error a client gets, from a route, an exception handler, a raw ASGI
middleware or the server protocol, is
{"type": "error", "error": {"type": ..., "message": ..., ...}, "request_id": ...},
built by `error_body` here and nowhere else, so that no answer can drift from
the shape clients parse. The proxy paths are the exception: there every
error is the provider's (llmquota.api.provider_errors), for the SDKs. The
exception handlers map the typed errors of the domain and of authentication
to their statuses in one table.

The request id sits beside `error`, not in it (as in Anthropic's API), so
the error object clients compare stays as it was. It is the id of the
request being answered (llmquota.api.requestids binds it), and it is all an
error says about the inside: an outage's driver text and an exception's
class are logged under that id, never sent.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from contextvars import ContextVar, Token
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import Send

from llmquota.api.auth import (
    AuthenticationFailed,
    Forbidden,
    TooManyFailedAuthentications,
)
from llmquota.api.methods import allowed_methods, options_answer
from llmquota.api.provider_errors import error_body as provider_error_body
from llmquota.api.provider_errors import proxy_kind
from llmquota.domain.errors import (
    IdempotencyConflict,
    InvalidRequest,
    NameInUse,
    PreconditionFailed,
    ReservationConflict,
    ReservationNotFound,
    StoreTimeout,
    StoreUnavailable,
    TenantSuspended,
    UnknownName,
    UnknownTenant,
    UnsupportedMediaType,
)
from llmquota.domain.refusals import ceil_seconds

log = logging.getLogger("llmquota.api")

# The id of the request this task is answering; None outside a request.
_request_id: ContextVar[str | None] = ContextVar("llmquota_request_id", default=None)


def bind_request_id(request_id: str) -> Token[str | None]:
    """Make `request_id` the id every error body of this request carries."""
    return _request_id.set(request_id)


def unbind_request_id(token: Token[str | None]) -> None:
    _request_id.reset(token)


def current_request_id() -> str | None:
    return _request_id.get()


def error_body(
    error_type: str, /, *, request_id: str | None = None, **fields: Any
) -> dict[str, Any]:
    """The error body; `fields` (a `message` among them) in the order given.

    The request id is `request_id`, else the id of the request being answered.
    """
    body: dict[str, Any] = {"type": "error", "error": {"type": error_type, **fields}}
    request_id = request_id or _request_id.get()
    if request_id is not None:
        body["request_id"] = request_id
    return body


def error_response(
    status: int, error_type: str, /, *, headers: Mapping[str, str] | None = None, **fields: Any
) -> JSONResponse:
    """An error answer from a route or an exception handler."""
    return JSONResponse(error_body(error_type, **fields), status_code=status, headers=headers)


async def send_error(
    send: Send,
    status: int,
    error_type: str,
    /,
    *,
    headers: Sequence[tuple[bytes, bytes]] = (),
    **fields: Any,
) -> None:
    """An error answer from a raw ASGI middleware, before any route runs."""
    # Byte for byte what a JSONResponse renders, so no answer tells which layer refused it.
    body = json.dumps(
        error_body(error_type, **fields), ensure_ascii=False, allow_nan=False, separators=(",", ":")
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


@dataclass(frozen=True, slots=True)
class AuthRefusal:
    """A refusal at authentication, the same from a route and from the fair-share middleware."""

    status: int
    error_type: str
    headers: dict[str, str]
    fields: dict[str, Any]


def auth_refusal(exc: AuthenticationFailed | TooManyFailedAuthentications) -> AuthRefusal:
    """How a refused authentication reads: 401 with no hint, or 429 for a throttled client."""
    if isinstance(exc, TooManyFailedAuthentications):
        ms = exc.retry_after_ms
        return AuthRefusal(
            429,
            "rate_limit_error",
            {"Retry-After": str(ceil_seconds(ms)), "retry-after-ms": str(ms)},
            {
                "message": str(exc),
                "limit": "authentication_failures",
                "scope": "client",
                "retry_after_ms": ms,
            },
        )
    return AuthRefusal(
        401,
        "authentication_error",
        {"WWW-Authenticate": "Bearer"},
        {"message": "missing or invalid API key"},
    )


async def send_auth_refusal(
    send: Send, exc: AuthenticationFailed | TooManyFailedAuthentications
) -> None:
    """A refused authentication from a raw ASGI middleware, before any route runs."""
    refusal = auth_refusal(exc)
    headers = [(k.lower().encode(), v.encode()) for k, v in refusal.headers.items()]
    await send_error(send, refusal.status, refusal.error_type, headers=headers, **refusal.fields)


# The typed errors whose message is the whole answer: (error, status, error type).
_SIMPLE: list[tuple[type[Exception], int, str]] = [
    (InvalidRequest, 422, "invalid_request_error"),
    (IdempotencyConflict, 422, "idempotency_conflict"),
    (UnknownTenant, 404, "not_found_error"),
    (UnknownName, 404, "not_found_error"),
    (NameInUse, 409, "conflict_error"),
    (PreconditionFailed, 412, "precondition_failed"),
    (UnsupportedMediaType, 415, "unsupported_media_type"),
    (ReservationNotFound, 404, "not_found_error"),
    (Forbidden, 403, "permission_error"),
    (TenantSuspended, 403, "tenant_suspended"),
]

# Starlette's own HTTP errors (unknown path, wrong method, ...) and those the
# middlewares and operations raise as HTTPException, by status.
_HTTP_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "method_not_allowed",
    408: "request_timeout",
    413: "payload_too_large",
}

# What a 503 says: a fixed sentence, whatever the driver said.
DATABASE_TIMED_OUT = "the limiter's database did not answer in time; retry"
DATABASE_UNAVAILABLE = "the limiter's database is unavailable; retry"


def _causes(exc: BaseException) -> list[BaseException]:
    """The exception and the chain of exceptions that caused it."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def unavailable_message(exc: BaseException) -> str:
    """The fixed sentence for an outage: a timeout, or any other failure."""
    if any(isinstance(cause, StoreTimeout) for cause in _causes(exc)):
        return DATABASE_TIMED_OUT
    return DATABASE_UNAVAILABLE


def internal_detail(exc: BaseException) -> str:
    """What went wrong inside, for the log only: each cause's class and text."""
    return " <- ".join(f"{type(cause).__name__}: {cause}" for cause in _causes(exc))


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for error in exc.errors()[:5]:
        if error.get("type") == "json_invalid":
            parts.append(f"body is not valid JSON ({error.get('ctx', {}).get('error', 'syntax')})")
            continue
        location = ".".join(str(p) for p in error.get("loc", ()) if p != "body")
        parts.append(f"{location or 'body'}: {error.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


async def _http_error(request: Request, exc: Exception) -> Response:
    """The router's and Starlette's own errors (404, 405, 413 ...) in the one shape,
    or the provider's on a proxy path; a 405 lists every method of the resource."""
    assert isinstance(exc, StarletteHTTPException)
    kind = proxy_kind(request.scope)
    if kind is not None:  # a body refused mid-read on a proxy path: the provider's format
        headers = dict(exc.headers or {})
        if exc.status_code == 413:
            headers["x-should-retry"] = "false"
        body = provider_error_body(kind, exc.status_code, str(exc.detail))
        return JSONResponse(body, status_code=exc.status_code, headers=headers)
    answer_headers = dict(exc.headers or {})
    if exc.status_code == 405:  # the router's Allow names one route's method: name all
        options = options_answer(request)
        if options is not None:
            return options
        answer_headers["Allow"] = ", ".join(allowed_methods(request))
    error_type = _HTTP_ERROR_TYPES.get(exc.status_code, "http_error")
    return error_response(
        exc.status_code, error_type, headers=answer_headers, message=str(exc.detail)
    )


def install_error_handlers(app: FastAPI) -> None:
    """Render every error the app may raise in the one shape."""
    for exc_type, status, error_type in _SIMPLE:

        async def handler(
            _request: Request, exc: Exception, status: int = status, error_type: str = error_type
        ) -> JSONResponse:
            return error_response(status, error_type, message=str(exc))

        app.add_exception_handler(exc_type, handler)

    async def unauthenticated(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, AuthenticationFailed | TooManyFailedAuthentications)
        refusal = auth_refusal(exc)
        return error_response(
            refusal.status, refusal.error_type, headers=refusal.headers, **refusal.fields
        )

    async def unavailable(_request: Request, exc: Exception) -> JSONResponse:
        log.warning(
            "request %s: limiter unavailable: %s", current_request_id(), internal_detail(exc)
        )
        # Never a 429: an outage must not look like a tenant over its limit.
        return error_response(
            503,
            "limiter_unavailable",
            message=unavailable_message(exc),
            headers={"Retry-After": "1"},
        )

    async def conflict(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ReservationConflict)
        # The state (settled, released, expired) is what a client branches on:
        # an expired lease already gave its capacity back (llmquota.client).
        return error_response(409, "conflict_error", message=str(exc), state=exc.state)

    async def invalid(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return error_response(422, "invalid_request_error", message=_validation_message(exc))

    app.add_exception_handler(AuthenticationFailed, unauthenticated)
    app.add_exception_handler(TooManyFailedAuthentications, unauthenticated)
    app.add_exception_handler(ReservationConflict, conflict)
    app.add_exception_handler(StoreUnavailable, unavailable)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(StarletteHTTPException, _http_error)
