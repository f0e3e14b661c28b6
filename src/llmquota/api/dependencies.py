"""What every route module shares: its services, its caller, its path names.

The app's lifespan puts one Limiter and one AdminService on `app.state`; the
routes take them (and the authenticated caller) as dependencies declared here
once, so that a route names what it needs and never reaches for the store.
The OpenAPI error entries live here too: every route documents its errors in
the one error shape.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Header, Path, Request

from llmquota.admin.alerts import AlertService
from llmquota.admin.service import AdminService
from llmquota.admission.limiter import Limiter
from llmquota.api.auth import Caller
from llmquota.api.schemas import ErrorResponse
from llmquota.domain.names import NAME_MAX_CHARS, NAME_PATTERN, NAME_RULE

_ERROR_DESCRIPTIONS = {
    400: "the body could not be parsed at all",
    401: "missing or invalid API key",
    429: "a limit has no room now (or too many failed authentications from this "
    "address); retry after retry_after_ms",
    403: "the key may not act on this tenant or endpoint",
    404: "no such tenant or reservation (another tenant's looks the same)",
    409: "the reservation's state does not allow this",
    412: "precondition_failed: the resource changed since the If-Match ETag (or is gone)",
    415: "the body's content-type is not one this endpoint reads",
    413: "the body is over the size limit, or the reservation can never fit",
    422: "invalid request: wrong types, out-of-range numbers, malformed JSON",
    503: "limiter_unavailable: the database did not answer in time; retryable",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for error statuses, all in the one error shape."""
    return {s: {"model": ErrorResponse, "description": _ERROR_DESCRIPTIONS[s]} for s in statuses}


# The getters below are `async def` although they never await: FastAPI runs a
# plain `def` dependency on its thread pool, a thread hop per request for one
# attribute read (a tenth of a worker's CPU on the admit route, measured).


async def get_limiter(request: Request) -> Limiter:
    limiter: Limiter = request.app.state.limiter
    return limiter


async def get_admin(request: Request) -> AdminService:
    admin: AdminService = request.app.state.admin
    return admin


async def get_alert_service(request: Request) -> AlertService:
    service: AlertService = request.app.state.alert_service
    return service


async def get_caller(
    request: Request, authorization: Annotated[str | None, Header()] = None
) -> Caller:
    client = request.client.host if request.client else ""
    caller: Caller = await request.app.state.authenticator.caller(
        authorization, client, request.scope
    )
    return caller


LimiterDep = Annotated[Limiter, Depends(get_limiter)]
AdminDep = Annotated[AdminService, Depends(get_admin)]
CallerDep = Annotated[Caller, Depends(get_caller)]
AlertServiceDep = Annotated[AlertService, Depends(get_alert_service)]


# Names in paths follow the one name pattern (domain.names), declared so that
# the OpenAPI schema shows it: a generated client refuses what the server would.
def _path_name() -> Any:
    return Path(
        min_length=1, max_length=NAME_MAX_CHARS, pattern=NAME_PATTERN, description=NAME_RULE
    )


TenantName = Annotated[str, _path_name()]
RouteName = Annotated[str, _path_name()]
# Plans, ceilings, quotas and webhooks are named like tenants and routes.
ObjectName = Annotated[str, _path_name()]
