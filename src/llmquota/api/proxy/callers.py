"""Who a proxied request is from: the tenant whose llmquota key it carries.

The key comes as `Authorization: Bearer` (the openai SDK) or `x-api-key` (the
anthropic SDK). A request that cannot call providers (no key, the admin key,
a key without the 'admit' scope, a suspended tenant) is answered here, in
the provider's error format; `read_request` also reads the body and finds
the upstream serving its model.
"""

from __future__ import annotations

from fastapi import Request, Response

from llmquota.api.auth import (
    AuthenticationFailed,
    Authenticator,
    Caller,
    TooManyFailedAuthentications,
)
from llmquota.api.proxy.requests import ProxyRequest, parse
from llmquota.api.proxy.upstream import Proxy, Upstream, missing_upstream, unserved_model
from llmquota.api.proxy.wire import Endpoint, Kind, error_response, kind_of


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
        caller = await authenticator.caller(authorization, client, request.scope)
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


async def read_request(
    endpoint: Endpoint, request: Request
) -> tuple[Caller, ProxyRequest, Upstream] | Response:
    """The caller's key, its request read and the upstream serving it; or the error to
    answer. Raises BadProxyRequest."""
    kind = kind_of(endpoint)
    proxy: Proxy = request.app.state.proxy
    if not proxy.configured(kind):
        return error_response(kind, 404, missing_upstream(kind), code="not_configured")
    caller = await proxy_caller(kind, request)
    if isinstance(caller, Response):
        return caller
    parsed = parse(
        endpoint,
        await request.body(),
        proxy.settings.proxy_default_max_tokens,
        lambda model: None if proxy.route(kind, model) else unserved_model(kind, model),
    )
    upstream = proxy.route(kind, parsed.model)
    if upstream is None:  # parse refused it already; kept for the type checker
        return error_response(kind, 404, unserved_model(kind, parsed.model), param="model")
    return caller, parsed, upstream
