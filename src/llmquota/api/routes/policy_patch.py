"""PATCH on the policy resources: JSON Merge Patch (RFC 7396) over the stored policy.

The stored policy is turned into the PUT body it amounts to (a tenant's: the
fields it sets itself and its plan), the patch is merged into it, and the
result is validated and written exactly as a PUT body would be. The write
carries the version the merge was made on as its If-Match, checked in the
write's own statement: a patch is never applied over a policy it did not see.
When the client sent If-Match itself, a concurrent change answers 412; when it
did not (or sent *), the merge is redone on the newer policy, a few times.
"""

from __future__ import annotations

import typing
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ValidationError

from llmquota.admin.service import AdminService
from llmquota.api.dependencies import AdminDep, CallerDep, RouteName, TenantName, error_responses
from llmquota.api.etags import if_match, set_etag
from llmquota.api.routes.policies import (
    LIMIT_FIELDS,
    PolicyTarget,
    policy_response,
    put_policy,
)
from llmquota.api.schemas import PolicyBody, PolicyResponse
from llmquota.domain.errors import InvalidRequest, PreconditionFailed, UnsupportedMediaType
from llmquota.domain.json_limits import loads_bounded
from llmquota.domain.merge_patch import merge_patch

M = TypeVar("M", bound=BaseModel)
R = TypeVar("R")

router = APIRouter(tags=["policies"], responses=error_responses(412, 415))

MERGE_PATCH = "application/merge-patch+json"
PATCH_MEDIA_TYPES = (MERGE_PATCH, "application/json")
# How a refusal of the merged result begins (a patch valid alone can make an
# invalid resource of the stored one, RFC 5789's 422).
MERGED_RESULT = "the patch makes an invalid "
# How often a PATCH without If-Match merges again after a concurrent write.
MERGE_ATTEMPTS = 5


# The PATCH request body as the OpenAPI document shows it.
def patch_body(schema: str) -> dict[str, Any]:
    """The OpenAPI request body of a PATCH whose result is a `schema`."""
    return {
        "requestBody": {
            "required": True,
            "content": {
                media: {"schema": {"$ref": f"#/components/schemas/{schema}"}}
                for media in PATCH_MEDIA_TYPES
            },
        }
    }


_PATCH_BODY = patch_body("PolicyBody")


async def read_merge_patch(request: Request) -> dict[str, Any]:
    """The PATCH body: a JSON object, sent as a merge patch (or plain JSON), else 415/422."""
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media not in PATCH_MEDIA_TYPES:
        raise UnsupportedMediaType(f"content-type: send {MERGE_PATCH} (or application/json)")
    try:
        patch = loads_bounded(await request.body())
    except ValueError as exc:
        raise InvalidRequest(f"body is not valid JSON ({exc})") from None
    if not isinstance(patch, dict):
        raise InvalidRequest("body: a merge patch of a policy is a JSON object")
    return patch


async def _stored_document(admin: AdminService, target: PolicyTarget) -> tuple[dict[str, Any], int]:
    """The PUT body the stored policy amounts to, and its version (UnknownTenant if none)."""
    scope, tenant, route = target.scope, target.tenant, target.route
    if scope == "tenant" and tenant is not None:
        own, plan, version = await admin.tenant_own_policy(tenant)
        document = dict(own)
        if plan is not None:
            document["plan"] = plan
    else:
        stored = await admin.get_policy(scope, tenant, route)
        document = {
            name: value
            for name, value in stored.policy.model_dump(mode="json", exclude_none=True).items()
            if name in PolicyBody.model_fields
        }
        if stored.fallback_models:
            document["fallback_models"] = list(stored.fallback_models)
        if scope == "global":
            document["shards"] = stored.shards
        version = stored.policy_version
    if "plan" not in document and all(document.get(name) is None for name in LIMIT_FIELDS):
        document["unlimited"] = True  # stored so: a patch need not say it again
    return document, version


def validated(model: type[M], document: dict[str, Any]) -> M:
    """`document` as `model`, or InvalidRequest naming each field that is wrong."""
    try:
        return model.model_validate(document)
    except ValidationError as exc:
        fields = [
            f"{'.'.join(str(p) for p in error['loc']) or 'body'}: {error['msg']}"
            for error in exc.errors()[:5]
        ]
        raise InvalidRequest("; ".join(fields)) from None


def refuse_unknown_members(model: type[BaseModel], patch: dict[str, Any]) -> None:
    """InvalidRequest naming a patch member `model` does not have, at any depth.

    Merging would drop a null member silently (it removes a field that was
    never there), so `{"tokens_per_mintue": null}` would answer 200 and change
    nothing; a PUT body with that member is refused, and so is the patch. An
    object member of a field that holds models (`output_estimate`: one of
    three strategies; `cache`) is merged member by member, so it is checked
    against the fields those models have.
    """
    _refuse_unknown((model,), patch, "")


def _refuse_unknown(models: Sequence[type[BaseModel]], patch: dict[str, Any], at: str) -> None:
    fields = {name: f for m in models for name, f in m.model_fields.items()}
    known = set(fields) | {f.alias for f in fields.values() if f.alias}
    for name, value in patch.items():
        if name not in known:
            raise InvalidRequest(f"{at}{name!r}: no such field (the fields: {', '.join(fields)})")
        nested = _models_of(fields[name].annotation) if name in fields else ()
        if nested and isinstance(value, dict):
            _refuse_unknown(nested, value, f"{at}{name}.")


def _models_of(annotation: Any) -> tuple[type[BaseModel], ...]:
    """The models a field may hold (`OutputEstimate | None`: its three strategies)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return (annotation,)
    return tuple(m for argument in typing.get_args(annotation) for m in _models_of(argument))


async def merged_write(
    request: Request,
    model: type[BaseModel],
    what: str,
    stored: Callable[[], Awaitable[tuple[dict[str, Any], int]]],
    write: Callable[[dict[str, Any], str], Awaitable[R]],
) -> R:
    """The PATCH every policy resource shares: the stored document and its
    version, the patch merged over it, written guarded by that version; merged
    again when another write came between, unless If-Match pinned a version.
    A member `model` lacks is refused before anything is read."""
    patch = await read_merge_patch(request)
    refuse_unknown_members(model, patch)
    wanted = if_match(request)
    pinned = wanted is not None and "*" not in wanted
    for _ in range(MERGE_ATTEMPTS):
        document, version = await stored()
        if pinned and wanted is not None and str(version) not in wanted:
            raise PreconditionFailed(f"{what} changed since that ETag")
        try:
            return await write(merge_patch(document, patch), str(version))
        except PreconditionFailed:
            if pinned:
                raise
        except InvalidRequest as exc:
            # The patch was fine alone; what it made of the stored resource is not.
            raise InvalidRequest(f"{MERGED_RESULT}{what}: {exc}") from None
    raise PreconditionFailed(f"{what} kept changing; retry the PATCH")


async def _patch(
    request: Request, response: Response, admin: AdminService, target: PolicyTarget
) -> PolicyResponse:
    async def write(document: dict[str, Any], version: str) -> PolicyResponse:
        body = validated(PolicyBody, document)
        stored = await put_policy(admin, target, body, [version])
        set_etag(response, stored.policy_version)
        return policy_response(stored)

    return await merged_write(
        request,
        PolicyBody,
        f"the {target.scope} policy",
        lambda: _stored_document(admin, target),
        write,
    )


@router.patch("/v1/policies/global", response_model=PolicyResponse, openapi_extra=_PATCH_BODY)
async def patch_global_policy(
    request: Request, response: Response, caller: CallerDep, admin: AdminDep
) -> PolicyResponse:
    """Change some global limits (JSON Merge Patch; null: back to no limit or the default)."""
    caller.require_admin()
    return await _patch(request, response, admin, PolicyTarget("global"))


@router.patch(
    "/v1/tenants/{tenant}/policy", response_model=PolicyResponse, openapi_extra=_PATCH_BODY
)
async def patch_tenant_policy(
    tenant: TenantName, request: Request, response: Response, caller: CallerDep, admin: AdminDep
) -> PolicyResponse:
    """Change some of a tenant's limits (JSON Merge Patch; null: back to the plan's)."""
    caller.require_admin()
    return await _patch(request, response, admin, PolicyTarget("tenant", tenant))


@router.patch(
    "/v1/tenants/{tenant}/routes/{route}/policy",
    response_model=PolicyResponse,
    openapi_extra=_PATCH_BODY,
)
async def patch_route_policy(
    tenant: TenantName,
    route: RouteName,
    *,
    request: Request,
    response: Response,
    caller: CallerDep,
    admin: AdminDep,
) -> PolicyResponse:
    """Change some of a route's limits (JSON Merge Patch; null: back to the default)."""
    caller.require_admin()
    return await _patch(request, response, admin, PolicyTarget("route", tenant, route))
