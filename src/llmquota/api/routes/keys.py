"""API keys: issue, list, revoke, rotate (of tenants and of admins); suspension.

Only the admin issues, revokes and rotates keys and suspends tenants; a
tenant key with the `read` scope may list its own tenant's keys. A revoked
key is refused (401) at once on the worker that revoked it (the route drops
it from that worker's key cache) and on every other when the database's
announcement reaches its key cache (milliseconds; RELIABILITY.md). The
admin service decides; these routes parse and render.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Path, Request, Response

from llmquota.admin.service import AdminService
from llmquota.admission.limiter import Limiter
from llmquota.api.auth import Authenticator
from llmquota.api.dependencies import AdminDep, CallerDep, TenantName, error_responses
from llmquota.api.key_schemas import (
    AdminKeyBody,
    KeyBody,
    KeyInfo,
    KeyResponse,
    RotateBody,
    SuspensionResponse,
)
from llmquota.domain.key_limits import KeyLimits
from llmquota.domain.keys import IssuedKey

router = APIRouter(tags=["keys"])

KeyId = Annotated[int, Path(ge=1, le=9_223_372_036_854_775_807)]


def _changed(request: Request, *, key_id: int | None = None, tenant: str | None = None) -> None:
    """This worker forgets the changed key (or tenant's keys) at once; the others
    when the database's announcement reaches them."""
    authenticator: Authenticator = request.app.state.authenticator
    if key_id is not None:
        authenticator.key_id_changed(key_id)
    if tenant is not None:
        authenticator.tenant_changed(tenant)


async def _suspensions_changed(request: Request) -> None:
    """This worker's limiter learns the suspension before the answer (whoever's
    key then asks, the admin's included); the others with the announcement."""
    limiter: Limiter = request.app.state.limiter
    await limiter.outage.policies_written()


def _issued(issued: IssuedKey) -> KeyResponse:
    return KeyResponse(key=issued.key, **KeyInfo.of(issued.record).model_dump())


@router.get("/v1/tenants/{tenant}/keys", response_model=list[KeyInfo])
async def list_keys(tenant: TenantName, caller: CallerDep, admin: AdminDep) -> list[KeyInfo]:
    """The tenant's keys, revoked ones too; never a secret."""
    caller.require_tenant(tenant)
    caller.require_scope("read")
    return [KeyInfo.of(record) for record in await admin.keys.list(tenant)]


@router.post("/v1/tenants/{tenant}/keys", status_code=201, response_model=KeyResponse)
async def create_key(
    tenant: TenantName,
    caller: CallerDep,
    admin: AdminDep,
    body: Annotated[KeyBody | None, Body()] = None,
) -> KeyResponse:
    """Issue an API key for a tenant (registering it if new). Shown once."""
    caller.require_admin()
    body = body or KeyBody()
    issued = await admin.keys.create(
        tenant,
        label=body.label,
        expires_at=body.expires_at,
        scopes=body.scopes,
        limits=body.limits,
    )
    return _issued(issued)


@router.put("/v1/tenants/{tenant}/keys/{key_id}/policy", response_model=KeyInfo)
async def put_key_policy(
    tenant: TenantName,
    key_id: KeyId,
    *,
    body: KeyLimits,
    caller: CallerDep,
    admin: AdminDep,
    request: Request,
) -> KeyInfo:
    """Replace the key's own limits and models (a field left out is no longer
    limited; `{}` lifts them all), decided from its next admission on, on every
    worker (the key's change is announced)."""
    caller.require_admin()
    await admin.keys.set_limits(tenant, key_id, body)
    _changed(request, key_id=key_id)
    record = next(r for r in await admin.keys.list(tenant) if r.key_id == key_id)
    return KeyInfo.of(record)


@router.delete(
    "/v1/tenants/{tenant}/keys/{key_id}", status_code=204, responses=error_responses(409)
)
async def revoke_key(
    tenant: TenantName, key_id: KeyId, caller: CallerDep, admin: AdminDep, request: Request
) -> Response:
    """Revoke a key: 401 from then on. Again: 204, nothing changes."""
    caller.require_admin()
    return await _revoke(admin, request, tenant, key_id)


@router.post(
    "/v1/tenants/{tenant}/keys/{key_id}/rotate",
    response_model=KeyResponse,
    responses=error_responses(409),
)
async def rotate_key(
    tenant: TenantName,
    key_id: KeyId,
    caller: CallerDep,
    admin: AdminDep,
    request: Request,
    *,
    body: Annotated[RotateBody | None, Body()] = None,
) -> KeyResponse:
    """A new secret for the key; the old one works `grace_seconds` more."""
    caller.require_admin()
    return await _rotate(admin, request, tenant, key_id, body)


@router.get("/v1/admin/keys", response_model=list[KeyInfo])
async def list_admin_keys(caller: CallerDep, admin: AdminDep) -> list[KeyInfo]:
    """The admin keys stored in the database (not LLMQUOTA_ADMIN_KEY), revoked ones too."""
    caller.require_admin()
    return [KeyInfo.of(record) for record in await admin.keys.list(None)]


@router.post("/v1/admin/keys", status_code=201, response_model=KeyResponse)
async def create_admin_key(
    caller: CallerDep, admin: AdminDep, body: Annotated[AdminKeyBody | None, Body()] = None
) -> KeyResponse:
    """Issue an admin key. Shown once."""
    caller.require_admin()
    body = body or AdminKeyBody()
    return _issued(await admin.keys.create(None, label=body.label, expires_at=body.expires_at))


@router.delete("/v1/admin/keys/{key_id}", status_code=204, responses=error_responses(409))
async def revoke_admin_key(
    key_id: KeyId, caller: CallerDep, admin: AdminDep, request: Request
) -> Response:
    """Revoke an admin key; 409 for the last one that stays usable."""
    caller.require_admin()
    return await _revoke(admin, request, None, key_id)


@router.post(
    "/v1/admin/keys/{key_id}/rotate", response_model=KeyResponse, responses=error_responses(409)
)
async def rotate_admin_key(
    key_id: KeyId,
    caller: CallerDep,
    admin: AdminDep,
    request: Request,
    body: Annotated[RotateBody | None, Body()] = None,
) -> KeyResponse:
    """A new secret for an admin key; the old one works `grace_seconds` more."""
    caller.require_admin()
    return await _rotate(admin, request, None, key_id, body)


async def _revoke(
    admin: AdminService, request: Request, tenant: str | None, key_id: int
) -> Response:
    """Revoke a tenant's key (an admin key for None), dropped from this worker's cache at once."""
    await admin.keys.revoke(tenant, key_id)
    _changed(request, key_id=key_id)
    return Response(status_code=204)


async def _rotate(
    admin: AdminService,
    request: Request,
    tenant: str | None,
    key_id: int,
    body: RotateBody | None,
) -> KeyResponse:
    """Rotate a tenant's key (an admin key for None); this worker forgets the old secret's
    cached entry at once, the others on the announcement."""
    issued = await admin.keys.rotate(tenant, key_id, (body or RotateBody()).grace_seconds)
    _changed(request, key_id=key_id)
    return _issued(issued)


@router.post("/v1/tenants/{tenant}/suspend", response_model=SuspensionResponse)
async def suspend(
    tenant: TenantName, caller: CallerDep, admin: AdminDep, request: Request
) -> SuspensionResponse:
    """New admissions of the tenant get 403 tenant_suspended; settling still works."""
    caller.require_admin()
    moment = await admin.keys.suspend(tenant, True)
    _changed(request, tenant=tenant)
    await _suspensions_changed(request)
    return SuspensionResponse(tenant=tenant, suspended=True, suspended_at=moment)


@router.post("/v1/tenants/{tenant}/resume", response_model=SuspensionResponse)
async def resume(
    tenant: TenantName, caller: CallerDep, admin: AdminDep, request: Request
) -> SuspensionResponse:
    """Lift a suspension; the tenant's keys work again."""
    caller.require_admin()
    await admin.keys.suspend(tenant, False)
    _changed(request, tenant=tenant)
    await _suspensions_changed(request)
    return SuspensionResponse(tenant=tenant, suspended=False, suspended_at=None)
