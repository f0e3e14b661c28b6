"""Calendar quotas of one API key: `/v1/tenants/{tenant}/keys/{key_id}/quotas`.

A key's quota counts only the requests that key makes (over all its tenant's
routes), decided in the admission statement with the tenant's and routes'
quotas, all or nothing; a refusal by it says `"scope": "key"`. The body and
the answer are a tenant quota's (routes/quotas.py), with `key_id` set. Admin
key only; a key the tenant does not have, or a revoked one, is a 404.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from llmquota.api.dependencies import AlertServiceDep, CallerDep, ObjectName, TenantName
from llmquota.api.routes.keys import KeyId
from llmquota.api.routes.quotas import CREATED, QuotaBody, quota_json
from llmquota.domain.quotas import quota_spec

router = APIRouter(tags=["quotas"])


@router.put("/v1/tenants/{tenant}/keys/{key_id}/quotas/{name}", status_code=200, responses=CREATED)
async def put_key_quota(
    *,
    tenant: TenantName,
    key_id: KeyId,
    name: ObjectName,
    body: QuotaBody,
    caller: CallerDep,
    svc: AlertServiceDep,
) -> JSONResponse:
    """Create (201) or replace (200) a calendar quota of one of the tenant's keys."""
    caller.require_admin()
    spec = quota_spec(**body.model_dump())
    quota, created = await svc.put_quota(tenant, None, name, spec, key_id)
    return JSONResponse(quota_json(quota), status_code=201 if created else 200)


@router.get("/v1/tenants/{tenant}/keys/{key_id}/quotas/{name}")
async def get_key_quota(
    tenant: TenantName, key_id: KeyId, name: ObjectName, caller: CallerDep, svc: AlertServiceDep
) -> dict[str, Any]:
    """One key quota with its current window's usage."""
    caller.require_admin()
    return quota_json(await svc.get_quota(tenant, None, name, key_id))


@router.get("/v1/tenants/{tenant}/keys/{key_id}/quotas")
async def list_key_quotas(
    tenant: TenantName, key_id: KeyId, caller: CallerDep, svc: AlertServiceDep
) -> dict[str, Any]:
    """The quotas of one key of the tenant."""
    caller.require_admin()
    quotas = await svc.list_quotas(tenant, key_id=key_id)
    return {"tenant": tenant, "key_id": key_id, "quotas": [quota_json(q) for q in quotas]}


@router.delete("/v1/tenants/{tenant}/keys/{key_id}/quotas/{name}", status_code=204)
async def delete_key_quota(
    tenant: TenantName, key_id: KeyId, name: ObjectName, caller: CallerDep, svc: AlertServiceDep
) -> None:
    """Delete a key quota; its past windows stay in the reports."""
    caller.require_admin()
    await svc.delete_quota(tenant, None, name, key_id)
