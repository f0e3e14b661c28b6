"""Errors in the providers' own formats, for the proxy paths.

An SDK pointed at llmquota decides what to raise, and whether and when to
retry, from the status, the error body and the headers, so every answer on a
proxy path is in the format of the provider that path imitates: OpenAI's
{"error": {"message", "type", "param", "code"}}, Anthropic's
{"type": "error", "error": {"type", "message"}}. The routes render them
through llmquota.api.proxy.wire; the raw ASGI middlewares that refuse a
request before any route runs (body size and time, fair share, remembered
bad keys) render them here, chosen by the request's path, so that a client
of the REST API keeps llmquota's own shape and a client of a proxy path
never sees it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal

from starlette.types import Scope, Send

Kind = Literal["openai", "anthropic"]

# The proxied paths and the wire format each speaks.
PROXY_PATHS: dict[str, Kind] = {
    "/v1/chat/completions": "openai",
    "/v1/completions": "openai",
    "/v1/embeddings": "openai",
    "/v1/messages": "anthropic",
    "/v1/messages/count_tokens": "anthropic",
}

_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    529: "overloaded_error",
}
_OPENAI_CODES = {
    401: "invalid_api_key",
    403: "permission_denied",
    404: "model_not_found",
    408: "request_timeout",
    413: "request_too_large",
    422: "invalid_value",
    429: "rate_limit_exceeded",
}


def proxy_kind(scope: Scope) -> Kind | None:
    """The wire format of a request's path, or None off the proxy paths."""
    path = str(scope.get("path", "")).rstrip("/")
    return PROXY_PATHS.get(path)


def error_body(
    kind: Kind,
    status: int,
    message: str,
    *,
    error_type: str | None = None,
    code: str | None = None,
    param: str | None = None,
) -> Any:
    """The provider's error body for `status`; `error_type` (and OpenAI's `code`
    and `param`) override the usual ones."""
    if kind == "anthropic":
        kind_type = error_type or _ANTHROPIC_TYPES.get(status, "api_error")
        return {"type": "error", "error": {"type": kind_type, "message": message}}
    default_type = "invalid_request_error" if status < 500 else "server_error"
    return {
        "error": {
            "message": message,
            "type": error_type or default_type,
            "param": param,
            "code": code or _OPENAI_CODES.get(status),
        }
    }


async def send_provider_error(
    send: Send,
    kind: Kind,
    status: int,
    message: str,
    *,
    headers: Sequence[tuple[bytes, bytes]] = (),
    error_type: str | None = None,
) -> None:
    """A provider-format error from a raw ASGI middleware, before any route runs."""
    body = json.dumps(
        error_body(kind, status, message, error_type=error_type),
        ensure_ascii=False,
        separators=(",", ":"),
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
