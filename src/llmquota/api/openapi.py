"""The OpenAPI document: what the models alone cannot say about each operation.

pydantic writes one schema per model, but the server's rules are sharper
than its models in three places, and a document clients are generated from
(and that schemathesis holds the server to in CI) must say them:

- One PolicyBody serves the three scopes, and each scope takes only some of
  its fields (`plan` and `prepaid` a tenant's, `shards` the global one's,
  ...): each policy operation gets its scope's schema, the others' fields
  allowed only as null (the server ignores a null one). A tenant or route
  PUT must set a limit, name a plan or say `"unlimited": true`.
- A PATCH body is a merge patch (RFC 7396): any field may be left out or be
  null (removed), so the PUT schema's required fields and rules between
  fields do not apply to the patch itself, only to its result, which the
  server checks against the stored resource (422 when it does not hold).
- Links (OpenAPI 3.1 "links") say which answer feeds which operation, so a
  client (and schemathesis's stateful phase) can admit (or count) a request
  of the tenant a policy was written for, and settle, release and heartbeat
  the reservation POST /v1/admit created.
"""

from __future__ import annotations

import copy
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from llmquota.domain.json_schemas import present

JsonObject = dict[str, Any]

_SCHEMAS = "#/components/schemas/"
_NOT_HERE = {"type": "null", "description": "not on this scope (null is ignored)"}

# Each policy operation's path: its scope's schema name, and the fields its
# scope does not take (put_policy refuses them when not null).
_POLICY_SCOPES: dict[str, tuple[str, tuple[str, ...]]] = {
    "/v1/policies/global": (
        "GlobalPolicyBody",
        (
            "plan",
            "prepaid",
            "fallback_models",
            "output_estimate",
            "cache",
            "admission",
            "unlimited",
            "request_cost",
            "uses_concurrency",
        ),
    ),
    "/v1/tenants/{tenant}/policy": ("TenantPolicyBody", ("shards",)),
    "/v1/tenants/{tenant}/routes/{route}/policy": (
        "RoutePolicyBody",
        ("plan", "prepaid", "shards"),
    ),
}
# A tenant or route policy limits something (check_limited): a limit, a weight,
# a plan, or "unlimited": true.
_LIMITED = {
    "anyOf": [
        present("tokens_per_minute", "integer"),
        present("requests_per_minute", "integer"),
        present("max_in_flight", "integer"),
        present("request_cost", "integer"),
        present("uses_concurrency", "boolean"),
        present("plan", "string"),
        {"required": ["unlimited"], "properties": {"unlimited": {"const": True}}},
    ]
}
_RESERVATION = "/v1/reservations/{reservation_id}/"


def install_openapi(app: FastAPI, max_wait_ms_cap: int) -> None:
    """Have `app.openapi()` return the document with the additions above (built once).

    `max_wait_ms_cap` is this server's bound on an admission's wait, a setting.
    """

    def openapi() -> JsonObject:
        if app.openapi_schema is None:
            document = get_openapi(
                title=app.title,
                version=app.version,
                summary=app.summary,
                routes=app.routes,
            )
            _scope_policies(document)
            _patches_are_merge_patches(document)
            _link_reservations(document)
            admit = document["components"]["schemas"]["AdmitBody"]["properties"]
            admit["max_wait_ms"]["anyOf"][0]["maximum"] = max_wait_ms_cap
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _body_schema(operation: JsonObject) -> list[JsonObject]:
    """The schema objects of an operation's request body, one per media type."""
    content = operation.get("requestBody", {}).get("content", {})
    return [media["schema"] for media in content.values() if "schema" in media]


def _scope_policies(document: JsonObject) -> None:
    """Each policy operation refers to its scope's own copy of PolicyBody."""
    schemas = document["components"]["schemas"]
    for path, (name, not_here) in _POLICY_SCOPES.items():
        scoped = copy.deepcopy(schemas["PolicyBody"])
        scoped["title"] = name
        for field in not_here:
            scoped["properties"][field] = dict(_NOT_HERE)
        schemas[name] = scoped
        if name != "GlobalPolicyBody":  # the global policy may limit nothing
            limited = copy.deepcopy(scoped)
            limited["allOf"] = [*limited.get("allOf", []), _LIMITED]
            schemas[f"{name}Put"] = limited
        for method, operation in document["paths"][path].items():
            target = f"{name}Put" if method == "put" and f"{name}Put" in schemas else name
            for schema in _body_schema(operation):
                schema["$ref"] = _SCHEMAS + target


def _patches_are_merge_patches(document: JsonObject) -> None:
    """A PATCH body: the PUT schema's fields, each nullable, none required, no rules
    between them."""
    schemas = document["components"]["schemas"]
    for operations in document["paths"].values():
        operation = operations.get("patch")
        if operation is None:
            continue
        for schema in _body_schema(operation):
            name = schema["$ref"].removeprefix(_SCHEMAS)
            patch = copy.deepcopy(schemas[name])
            for rule in ("required", "allOf", "anyOf", "oneOf"):
                patch.pop(rule, None)
            patch["properties"] = {
                field: _patch_value(value, schemas) for field, value in patch["properties"].items()
            }
            patch["title"] = f"{name}Patch"
            schemas[f"{name}Patch"] = patch
            schema["$ref"] = _SCHEMAS + f"{name}Patch"


def _patch_value(schema: JsonObject, schemas: JsonObject) -> JsonObject:
    """A field of a merge patch: its own schema or null (null removes it, RFC 7396).

    An object-valued field (output_estimate, cache) is merged into the stored one
    member by member, so only the merged object has to be valid: the patch
    says "an object" whose members are ones the field's models have (the
    server refuses any other, even as null), and the server judges the result.
    """
    alternatives = schema.get("anyOf", [schema])
    targets = [
        reference
        for alternative in alternatives
        for reference in [alternative, *alternative.get("oneOf", [])]
        if "$ref" in reference
    ]
    if not targets:
        return {"anyOf": [schema, {"type": "null"}]}
    members = sorted(
        {
            member
            for reference in targets
            for member in schemas[reference["$ref"].removeprefix(_SCHEMAS)].get("properties", {})
        }
    )
    merged = {
        "type": "object",
        "properties": {member: {} for member in members},
        "additionalProperties": False,
    }
    return {"anyOf": [merged, {"type": "null"}]}


def _operation_id(document: JsonObject, path: str, method: str) -> str:
    operation_id: str = document["paths"][path][method]["operationId"]
    return operation_id


def _link_reservations(document: JsonObject) -> None:
    """A tenant's policy written links to an admission of that tenant (and to a
    count of one), and POST /v1/admit's 201 to settle, release and heartbeat its
    reservation."""
    written = document["paths"]["/v1/tenants/{tenant}/policy"]["put"]["responses"]["200"]
    request = {"tenant": "$request.path.tenant", "model": "gpt-4o", "input_tokens": 1}
    written["links"] = {
        "Admit": {
            "operationId": _operation_id(document, "/v1/admit", "post"),
            "requestBody": {**request, "max_tokens": 1},
            "description": "admit a request of the tenant whose policy this is",
        },
        "CountTokens": {
            "operationId": _operation_id(document, "/v1/tokens/count", "post"),
            "requestBody": {**request, "max_tokens": 1},
            "description": "count what admitting a request of this tenant would reserve",
        },
    }
    created = document["paths"]["/v1/admit"]["post"]["responses"]["201"]
    created["links"] = {
        action.capitalize(): {
            "operationId": _operation_id(document, _RESERVATION + action, "post"),
            "parameters": {"reservation_id": "$response.body#/reservation_id"},
            "description": f"{action} the reservation this admission created",
        }
        for action in ("settle", "release", "heartbeat")
    }
