"""Calendar quotas, prepaid credits and a tenant's alerts.

Admin key only. The bodies are parsed by pydantic in strict mode (a wrong
JSON type, `true` or `"100"` for a number among them, is a 422 naming the
field) and checked by domain.quotas, which names the field of any value it
refuses; the AlertService stores them.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictStr
from pydantic.config import JsonDict

from llmquota.admin.alerts import AlertService
from llmquota.api.dependencies import AlertServiceDep, CallerDep, ObjectName, RouteName, TenantName
from llmquota.domain.alerts import AlertEvent
from llmquota.domain.json_numbers import WholeNumber
from llmquota.domain.json_text import pattern_field, storable_text_pattern
from llmquota.domain.money import money_text
from llmquota.domain.names import ModelGlob
from llmquota.domain.quotas import (
    AMOUNT_PATTERN,
    MAX_ALERTS,
    MAX_MODELS,
    MAX_QUOTA_TOKENS,
    MAX_REFERENCE_CHARS,
    ZERO_AMOUNT_PATTERN,
    Enforce,
    Period,
    Quota,
    TopUp,
    check_amount,
    check_reference,
    known_timezones,
    quota_spec,
)

REFERENCE_PATTERN = storable_text_pattern(MAX_REFERENCE_CHARS)

router = APIRouter(tags=["quotas"])
# The PUTs and the top-up answer 201 when they create, 200 when it existed.
CREATED: dict[int | str, dict[str, Any]] = {201: {"description": "created"}}


def _known_zones(schema: dict[str, Any]) -> None:
    """The schema's `timezone` enum: the zones this server's zone database knows."""
    schema["enum"] = known_timezones()


Timezone = Annotated[StrictStr, Field(json_schema_extra=_known_zones)]
Cost = Annotated[
    StrictStr,
    Field(
        pattern=AMOUNT_PATTERN,
        json_schema_extra={"not": {"pattern": ZERO_AMOUNT_PATTERN}},
        description='a positive decimal string, e.g. "250.00"',
    ),
]
Alert = Annotated[StrictFloat, Field(gt=0, le=1)]
# A quota needs a budget: tokens or cost (or both), not null.
_NEEDS_A_BUDGET: JsonDict = {
    "anyOf": [
        {"required": ["tokens"], "properties": {"tokens": {"type": "integer"}}},
        {"required": ["cost"], "properties": {"cost": {"type": "string"}}},
    ]
}


class QuotaBody(BaseModel):
    """PUT body of a quota: `tokens` and/or `cost` per calendar `period`."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=_NEEDS_A_BUDGET)

    period: Period
    timezone: Timezone = "UTC"
    tokens: Annotated[int, WholeNumber(ge=1, le=MAX_QUOTA_TOKENS)] | None = None
    # Money is a decimal string: a JSON number would have lost cents already.
    cost: Cost | None = None
    models: Annotated[list[ModelGlob], Field(max_length=MAX_MODELS)] | None = None
    alerts: Annotated[list[Alert], Field(max_length=MAX_ALERTS)] | None = None
    enforce: Enforce = "block"


Reference = Annotated[
    StrictStr,
    pattern_field(REFERENCE_PATTERN, MAX_REFERENCE_CHARS, "1 to 255 characters, no NUL"),
]


class TopUpBody(BaseModel):
    """POST body of a top-up: `amount` a decimal string; `reference` makes it idempotent."""

    model_config = ConfigDict(extra="forbid")

    amount: Cost
    reference: Reference


def quota_json(quota: Quota) -> dict[str, Any]:
    """A quota as the API shows it, with its current window and that window's usage."""
    spec = quota.spec
    return {
        "tenant": quota.tenant,
        "route": quota.route,
        "key_id": quota.key_id,
        "name": quota.name,
        "period": spec.period,
        "timezone": spec.timezone,
        "tokens": spec.tokens,
        "cost": None if spec.cost is None else str(spec.cost),
        "models": list(spec.models),
        "alerts": [float(a) for a in spec.alerts],
        "enforce": spec.enforce,
        "window": {
            "start": quota.window_start.isoformat(),
            "end": quota.window_end.isoformat(),
            "usage_tokens": quota.usage_tokens,
            "usage_cost": money_text(quota.usage_cost),
        },
        "created_at": quota.created_at.isoformat(),
        "updated_at": quota.updated_at.isoformat(),
    }


def alert_json(event: AlertEvent) -> dict[str, Any]:
    """An alert as the API lists it: the webhook body plus how delivery stands."""
    return {
        **event.body(),
        "subject": event.subject,
        "created_at": event.created_at.isoformat() if event.created_at else None,
        "deliveries": {
            "total": event.deliveries,
            "delivered": event.delivered,
            "gave_up": event.gave_up,
        },
    }


def _topup_json(topup: TopUp) -> dict[str, Any]:
    return {
        "entry_id": topup.entry_id,
        "amount": money_text(topup.amount),
        "reference": topup.reference,
        "recorded_at": topup.recorded_at.isoformat(),
    }


async def _put(
    service: AlertService, tenant: str, route: str | None, name: str, body: QuotaBody
) -> JSONResponse:
    spec = quota_spec(**body.model_dump())
    quota, created = await service.put_quota(tenant, route, name, spec)
    return JSONResponse(quota_json(quota), status_code=201 if created else 200)


@router.put("/v1/tenants/{tenant}/quotas/{name}", status_code=200, responses=CREATED)
async def put_tenant_quota(
    tenant: TenantName, name: ObjectName, body: QuotaBody, caller: CallerDep, svc: AlertServiceDep
) -> JSONResponse:
    """Create (201) or replace (200) a calendar quota over all the tenant's routes."""
    caller.require_admin()
    return await _put(svc, tenant, None, name, body)


@router.put("/v1/tenants/{tenant}/routes/{route}/quotas/{name}", status_code=200, responses=CREATED)
async def put_route_quota(
    *,
    tenant: TenantName,
    route: RouteName,
    name: ObjectName,
    body: QuotaBody,
    caller: CallerDep,
    svc: AlertServiceDep,
) -> JSONResponse:
    """Create (201) or replace (200) a calendar quota of one route of the tenant."""
    caller.require_admin()
    return await _put(svc, tenant, route, name, body)


@router.get("/v1/tenants/{tenant}/quotas/{name}")
async def get_tenant_quota(
    tenant: TenantName, name: ObjectName, caller: CallerDep, svc: AlertServiceDep
) -> dict[str, Any]:
    """One tenant quota with its current window's usage."""
    caller.require_admin()
    return quota_json(await svc.get_quota(tenant, None, name))


@router.get("/v1/tenants/{tenant}/routes/{route}/quotas/{name}")
async def get_route_quota(
    tenant: TenantName, route: RouteName, name: ObjectName, caller: CallerDep, svc: AlertServiceDep
) -> dict[str, Any]:
    """One route quota with its current window's usage."""
    caller.require_admin()
    return quota_json(await svc.get_quota(tenant, route, name))


@router.get("/v1/tenants/{tenant}/quotas")
async def list_tenant_quotas(
    tenant: TenantName, caller: CallerDep, svc: AlertServiceDep
) -> dict[str, Any]:
    """Every quota of the tenant, its routes' included."""
    caller.require_admin()
    return {"tenant": tenant, "quotas": [quota_json(q) for q in await svc.list_quotas(tenant)]}


@router.get("/v1/tenants/{tenant}/routes/{route}/quotas")
async def list_route_quotas(
    tenant: TenantName, route: RouteName, caller: CallerDep, svc: AlertServiceDep
) -> dict[str, Any]:
    """The quotas of one route of the tenant."""
    caller.require_admin()
    quotas = await svc.list_quotas(tenant, route)
    return {"tenant": tenant, "route": route, "quotas": [quota_json(q) for q in quotas]}


@router.delete("/v1/tenants/{tenant}/quotas/{name}", status_code=204)
async def delete_tenant_quota(
    tenant: TenantName, name: ObjectName, caller: CallerDep, svc: AlertServiceDep
) -> None:
    """Delete a tenant quota; its past windows stay in the reports."""
    caller.require_admin()
    await svc.delete_quota(tenant, None, name)


@router.delete("/v1/tenants/{tenant}/routes/{route}/quotas/{name}", status_code=204)
async def delete_route_quota(
    tenant: TenantName, route: RouteName, name: ObjectName, caller: CallerDep, svc: AlertServiceDep
) -> None:
    """Delete a route quota; its past windows stay in the reports."""
    caller.require_admin()
    await svc.delete_quota(tenant, route, name)


@router.post("/v1/tenants/{tenant}/credits", responses=CREATED)
async def top_up(
    tenant: TenantName, body: TopUpBody, caller: CallerDep, svc: AlertServiceDep
) -> JSONResponse:
    """Add prepaid credit: 201 when added, 200 when this reference was added before
    (`applied` false: nothing was added again)."""
    caller.require_admin()
    amount = check_amount("amount", body.amount)
    reference = check_reference(body.reference)
    topup = await svc.top_up(tenant, amount, reference)
    account = await svc.credits(tenant)
    answer = {
        "tenant": tenant,
        "applied": topup.applied,
        **_topup_json(topup),
        "balance": money_text(account.balance),
        "reserved": money_text(account.reserved),
    }
    return JSONResponse(answer, status_code=201 if topup.applied else 200)


@router.get("/v1/tenants/{tenant}/credits")
async def get_credits(
    tenant: TenantName, caller: CallerDep, svc: AlertServiceDep
) -> dict[str, Any]:
    """Balance, what open reservations hold, what is available, and the last top-ups."""
    caller.require_admin()
    account = await svc.credits(tenant)
    return {
        "tenant": tenant,
        "balance": money_text(account.balance),
        "reserved": money_text(account.reserved),
        "available": money_text(account.available),
        "topups": [_topup_json(t) for t in account.topups],
    }


@router.get("/v1/tenants/{tenant}/alerts")
async def list_alerts(
    tenant: TenantName,
    caller: CallerDep,
    svc: AlertServiceDep,
    limit: Annotated[int, Query(ge=1, le=1_000)] = 100,
) -> dict[str, Any]:
    """The tenant's alerts, newest first, with how their deliveries stand."""
    caller.require_admin()
    alerts = await svc.list_alerts(tenant, limit)
    return {"tenant": tenant, "alerts": [alert_json(a) for a in alerts]}
