"""The tenant directory: GET /v1/tenants (a page at a time) and DELETE /v1/tenants/{t}.

Pages are keyset pages on the tenant name (the primary key), never OFFSET:
the cursor is the last name of the page, base64url-encoded, and the next
page starts after it, so a tenant added or deleted meanwhile neither repeats
nor skips another. A delete is one statement (lq_delete_tenant) that refuses
while the tenant has active reservations and never touches the usage ledger.
"""

from __future__ import annotations

import base64
import binascii
from datetime import datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request, Response
from pydantic import BaseModel, Field

from llmquota.api.auth import Authenticator
from llmquota.api.dependencies import AdminDep, CallerDep, TenantName, error_responses
from llmquota.api.errors import error_response
from llmquota.api.etags import if_match
from llmquota.domain.errors import InvalidRequest, TenantBusy
from llmquota.domain.names import NAME_MAX_CHARS, NAME_PATTERN, NAME_RULE, is_name

router = APIRouter(tags=["tenants"])

DEFAULT_PAGE = 100
MAX_PAGE = 1000


class TenantSummary(BaseModel):
    """One tenant of the directory."""

    tenant: str
    plan: str | None
    status: Literal["active", "suspended"] = Field(
        description="suspended between POST .../suspend and .../resume, else active"
    )
    last_activity_at: datetime | None = Field(
        description="when its latest reservation was admitted; null when it has none"
    )


class TenantPage(BaseModel):
    """GET /v1/tenants."""

    tenants: list[TenantSummary]
    next_cursor: str | None = Field(description="the cursor of the next page; null at the end")


def encode_cursor(tenant: str) -> str:
    return base64.urlsafe_b64encode(tenant.encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> str:
    """The tenant name a cursor continues after, or InvalidRequest naming `cursor`."""
    try:
        name = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        name = ""
    if not is_name(name):
        raise InvalidRequest("cursor: not a cursor this API returned")
    return name


@router.get("/v1/tenants", response_model=TenantPage)
async def list_tenants(
    caller: CallerDep,
    admin: AdminDep,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = DEFAULT_PAGE,
    cursor: Annotated[str | None, Query(max_length=512)] = None,
    plan: Annotated[
        str | None,
        Query(min_length=1, max_length=NAME_MAX_CHARS, pattern=NAME_PATTERN, description=NAME_RULE),
    ] = None,
) -> TenantPage:
    """Tenants by name, `limit` at a time (1..1000, default 100), on `plan` when named."""
    caller.require_admin()
    after = None if cursor is None else decode_cursor(cursor)
    # One more than the page: whether a next page exists, without a second query.
    rows = await admin.list_tenants(after, limit + 1, plan)
    page = rows[:limit]
    more = len(rows) > limit
    return TenantPage(
        tenants=[
            TenantSummary(
                tenant=row.tenant,
                plan=row.plan,
                status=row.status,
                last_activity_at=row.last_activity_at,
            )
            for row in page
        ],
        next_cursor=encode_cursor(page[-1].tenant) if more else None,
    )


@router.delete(
    "/v1/tenants/{tenant}",
    status_code=204,
    response_class=Response,
    responses=error_responses(409, 412),
)
async def delete_tenant(
    tenant: TenantName, request: Request, caller: CallerDep, admin: AdminDep
) -> Response:
    """Delete a tenant's layers, keys and policy (409 while it has active reservations).

    The usage ledger keeps the tenant's rows. If-Match is checked against the
    tenant policy's ETag.
    """
    caller.require_admin()
    try:
        await admin.delete_tenant(tenant, if_match(request))
    except TenantBusy as exc:
        return error_response(
            409,
            "conflict_error",
            message=str(exc),
            active_reservations=exc.active_reservations,
        )
    # This worker forgets the tenant's keys at once (as for a suspension); the
    # others when the database's announcement reaches them.
    authenticator: Authenticator = request.app.state.authenticator
    authenticator.tenant_changed(tenant)
    return Response(status_code=204)
