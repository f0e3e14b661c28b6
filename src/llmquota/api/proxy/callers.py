"""Who a proxied request is from: the tenant whose llmquota key it carries.

The key comes as `Authorization: Bearer` (the openai SDK) or `x-api-key` (the
anthropic SDK). A request that cannot call providers (no key, the admin key,
a key without the 'admit' scope, a suspended tenant) is answered here, in
the provider's error format.
"""

from __future__ import annotations

from fastapi import Request, Response

from llmquota.api.auth import (
    AuthenticationFailed,
    Authenticator,
    Caller,
    TooManyFailedAuthentications,
)
from llmquota.api.proxy.wire import Kind, error_response


async def proxy_caller(kind: Kind, request: Request) -> Caller | Response:
    """The tenant key the request carries (its tenant, limits and models), or the
    error to answer."""
    authorization = request.headers.get("authorization")
    api_key = request.headers.get("x-api-key")
    if api_key and not (authorization or "").lower().startswith("bearer "):
        authorization = f"Bearer {api_key}"
    authenticator: Authenticator = request.app.state.authenticator
    client = request.client.host if request.client else ""
    try:
        caller = await authenticator.caller(authorization, client)
    except AuthenticationFailed:
        return error_response(kind, 401, "missing or invalid llmquota API key")
    except TooManyFailedAuthentications as exc:
        retry_ms = str(exc.retry_after_ms)
        return error_response(
            kind,
            429,
            str(exc),
            headers={
                "retry-after": str(-(-exc.retry_after_ms // 1000)),
                "retry-after-ms": retry_ms,
            },
        )
    if caller.tenant is None:
        return error_response(kind, 403, "the admin key cannot call providers: use a tenant's key")
    if "admit" not in caller.scopes:
        return error_response(kind, 403, "this key lacks the 'admit' scope")
    if caller.suspended:
        return error_response(
            kind, 403, f"tenant {caller.tenant!r} is suspended", error_type="tenant_suspended"
        )
    return caller
