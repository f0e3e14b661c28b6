"""The FastAPI application: wiring, error rendering and the lifespan.

`create_app(settings)` builds an app whose lifespan opens one Limiter (one
pool) per worker process, and the admin service over the same store. Errors
are rendered in one shape everywhere:
{"type": "error", "error": {"type": ..., "message": ...}}.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Scope

from llmquota.admin.service import AdminService
from llmquota.admission.limiter import Limiter
from llmquota.api.auth import AuthenticationFailed, Authenticator, Forbidden
from llmquota.api.bodylimit import BodySizeLimit
from llmquota.api.fairness import TenantFairShare
from llmquota.api.routes import router
from llmquota.config import Settings
from llmquota.domain.errors import (
    IdempotencyConflict,
    InvalidRequest,
    ReservationConflict,
    ReservationNotFound,
    StoreUnavailable,
    UnknownTenant,
)


def error_response(
    status: int, error_type: str, message: str, headers: dict[str, str] | None = None, **extra: Any
) -> JSONResponse:
    """The one error shape of the API."""
    return JSONResponse(
        {"type": "error", "error": {"type": error_type, "message": message, **extra}},
        status_code=status,
        headers=headers,
    )


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for error in exc.errors()[:5]:
        if error.get("type") == "json_invalid":
            parts.append(f"body is not valid JSON ({error.get('ctx', {}).get('error', 'syntax')})")
            continue
        location = ".".join(str(p) for p in error.get("loc", ()) if p != "body")
        parts.append(f"{location or 'body'}: {error.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


def _install_error_handlers(app: FastAPI) -> None:
    simple: list[tuple[type[Exception], int, str]] = [
        (InvalidRequest, 422, "invalid_request_error"),
        (IdempotencyConflict, 422, "idempotency_conflict"),
        (UnknownTenant, 404, "not_found_error"),
        (ReservationNotFound, 404, "not_found_error"),
        (ReservationConflict, 409, "conflict_error"),
        (Forbidden, 403, "permission_error"),
    ]
    for exc_type, status, error_type in simple:

        async def handler(
            _request: Request, exc: Exception, status: int = status, error_type: str = error_type
        ) -> JSONResponse:
            return error_response(status, error_type, str(exc))

        app.add_exception_handler(exc_type, handler)

    async def unauthenticated(_request: Request, _exc: Exception) -> JSONResponse:
        return error_response(
            401,
            "authentication_error",
            "missing or invalid API key",
            headers={"WWW-Authenticate": "Bearer"},
        )

    async def unavailable(_request: Request, exc: Exception) -> JSONResponse:
        # Never a 429: an outage must not look like a tenant over its limit.
        return error_response(503, "limiter_unavailable", str(exc), headers={"Retry-After": "1"})

    async def invalid(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return error_response(422, "invalid_request_error", _validation_message(exc))

    async def http_error(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        error_type = {
            400: "invalid_request_error",
            404: "not_found_error",
            405: "method_not_allowed",
            413: "payload_too_large",
        }.get(exc.status_code, "http_error")
        return error_response(exc.status_code, error_type, str(exc.detail))

    app.add_exception_handler(AuthenticationFailed, unauthenticated)
    app.add_exception_handler(StoreUnavailable, unavailable)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(StarletteHTTPException, http_error)


def _tenant_of(scope: Scope) -> str | None:
    """The tenant of a request's key, if this worker knows it already (no I/O)."""
    authenticator: Authenticator | None = getattr(scope["app"].state, "authenticator", None)
    if authenticator is None:
        return None
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            return authenticator.cached_tenant(value.decode("latin-1"))
    return None


def create_app(settings: Settings | None = None, dsn: str | None = None) -> FastAPI:
    """Build the app; the database is `dsn`, else settings.database_url."""
    settings = settings or Settings()
    database = dsn or settings.database_url
    if not database:
        raise RuntimeError("no database: set LLMQUOTA_DATABASE_URL or use `llmquota serve`")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        limiter = await Limiter.connect(database, settings)
        admin = AdminService(limiter.store, deadline_seconds=limiter.deadline_seconds)
        app.state.limiter = limiter
        app.state.admin = admin
        app.state.authenticator = Authenticator(admin.find_key, settings.admin_key)
        try:
            yield
        finally:
            await limiter.close()

    app = FastAPI(
        title="llmquota",
        summary="Admission control for LLM providers: reserve, then settle.",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.add_middleware(BodySizeLimit, max_body_bytes=settings.max_body_bytes)
    app.add_middleware(
        TenantFairShare,
        tenant_of=_tenant_of,
        max_in_progress=settings.tenant_max_in_progress,
        max_waiting=settings.tenant_max_waiting,
    )
    _install_error_handlers(app)
    app.include_router(router)
    return app


def create_app_from_env() -> FastAPI:
    """Factory for uvicorn workers: everything from LLMQUOTA_* variables."""
    return create_app(Settings())
