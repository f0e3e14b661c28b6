"""Webhooks: where alerts are POSTed. Admin key only.

A webhook takes every tenant's alerts, or one tenant's. Its URL must be
http(s) and may not reach anything but a public address (SSRF): loopback,
private and other non-public addresses only within
LLMQUOTA_WEBHOOK_ALLOWED_NETWORKS (on-premise receivers), link-local (cloud
metadata) and this service itself never (llmquota.domain.destinations). The
secret signs every delivery and is never shown again; credentials embedded in
the URL (userinfo, token-like query parameters) are shown masked
(llmquota.domain.url_masking).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictStr

from llmquota.api.dependencies import AlertServiceDep, CallerDep, ObjectName
from llmquota.api.webhooks import check_webhook_target
from llmquota.config import Settings
from llmquota.domain.alerts import (
    MAX_SECRET_BYTES,
    MAX_URL_CHARS,
    MIN_SECRET_BYTES,
    Webhook,
    check_secret,
)
from llmquota.domain.names import Name
from llmquota.domain.url_masking import mask_url
from llmquota.domain.validation import check_name

router = APIRouter(tags=["webhooks"])
# What check_webhook_url takes at least: http(s), then printable ASCII (no spaces).
URL_PATTERN = r"^https?://[!-~]+$"


class WebhookBody(BaseModel):
    """PUT body of a webhook: `url`, `secret` (16 bytes or more), optional `tenant`."""

    model_config = ConfigDict(extra="forbid")

    url: Annotated[
        StrictStr,
        Field(
            max_length=MAX_URL_CHARS,
            pattern=URL_PATTERN,
            description="an http(s) URL, printable ASCII; its host must pass the "
            "destination rules (LLMQUOTA_WEBHOOK_*)",
        ),
    ]
    # Characters, each one byte or more: 16 of them are at least 16 bytes. The
    # server counts UTF-8 bytes (at most MAX_SECRET_BYTES), which no schema can.
    secret: Annotated[
        StrictStr,
        Field(min_length=MIN_SECRET_BYTES, max_length=MAX_SECRET_BYTES, pattern=r"^[^\x00]*$"),
    ]
    tenant: Name | None = None


def webhook_json(hook: Webhook) -> dict[str, Any]:
    """A webhook as the API shows it: never its secret, nor a credential in its URL."""
    return {
        "name": hook.name,
        "url": mask_url(hook.url),
        "tenant": hook.tenant,
        "created_at": hook.created_at.isoformat() if hook.created_at else None,
        "updated_at": hook.updated_at.isoformat() if hook.updated_at else None,
    }


def own_addresses(request: Request) -> list[tuple[str, int]]:
    """Where this service is listening, as far as the request tells: the socket it
    arrived on and the host the client addressed."""
    own: list[tuple[str, int]] = []
    server = request.scope.get("server")
    if server and server[1] is not None:
        own.append((str(server[0]), int(server[1])))
    url = request.url
    if url.hostname:
        own.append((url.hostname, url.port or (443 if url.scheme == "https" else 80)))
    return own


@router.put("/v1/webhooks/{name}", responses={201: {"description": "created"}})
async def put_webhook(
    name: ObjectName, body: WebhookBody, request: Request, caller: CallerDep, svc: AlertServiceDep
) -> JSONResponse:
    """Create (201) or replace (200) a webhook."""
    caller.require_admin()
    settings: Settings = request.app.state.settings
    url = await check_webhook_target(body.url, settings.destination_rules(own_addresses(request)))
    secret = check_secret(body.secret)
    tenant = None if body.tenant is None else check_name("tenant", body.tenant)
    hook, created = await svc.put_webhook(name, url, secret, tenant)
    return JSONResponse(webhook_json(hook), status_code=201 if created else 200)


@router.get("/v1/webhooks/{name}")
async def get_webhook(name: ObjectName, caller: CallerDep, svc: AlertServiceDep) -> dict[str, Any]:
    """One webhook (without its secret)."""
    caller.require_admin()
    return webhook_json(await svc.get_webhook(name))


@router.get("/v1/webhooks")
async def list_webhooks(caller: CallerDep, svc: AlertServiceDep) -> dict[str, Any]:
    """Every webhook (without their secrets)."""
    caller.require_admin()
    return {"webhooks": [webhook_json(h) for h in await svc.list_webhooks()]}


@router.delete("/v1/webhooks/{name}", status_code=204)
async def delete_webhook(name: ObjectName, caller: CallerDep, svc: AlertServiceDep) -> None:
    """Delete a webhook; its pending deliveries go with it."""
    caller.require_admin()
    await svc.delete_webhook(name)
