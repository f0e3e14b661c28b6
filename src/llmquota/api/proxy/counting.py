"""POST /v1/messages/count_tokens: a count, reserving nothing.

Counted here exactly as /v1/messages counts the same body for its admission,
or (LLMQUOTA_PROXY_COUNT_TOKENS=upstream) passed to the Anthropic upstream
with llmquota's key and its answer passed back scrubbed.
"""

from __future__ import annotations

import httpx
from fastapi import Request, Response
from fastapi.responses import JSONResponse

from llmquota.admission.limiter import Limiter
from llmquota.api.proxy.answers import (
    passed_back,
    pool_refused,
    upstream_error,
    upstream_failed,
    upstream_request,
)
from llmquota.api.proxy.callers import read_request
from llmquota.api.proxy.pool import PoolRefusal
from llmquota.api.proxy.requests import BadProxyRequest
from llmquota.api.proxy.upstream import Proxy, Upstream
from llmquota.api.proxy.wire import Kind, error_response
from llmquota.domain.errors import InvalidRequest


async def count_tokens_answer(request: Request) -> Response:
    """POST /v1/messages/count_tokens: `{"input_tokens": N}` as Anthropic answers it,
    N counted exactly as /v1/messages counts the same body for its admission
    (system prompt and tools included); or, with PROXY_COUNT_TOKENS=upstream,
    the upstream's own answer. Either way nothing is reserved or settled."""
    kind: Kind = "anthropic"
    proxy: Proxy = request.app.state.proxy
    try:
        read = await read_request("count_tokens", request)
        if isinstance(read, Response):
            return read
        caller, parsed, upstream = read
        tenant = str(caller.tenant)
        if proxy.settings.proxy_count_tokens == "upstream":
            return await _count_upstream(proxy, upstream, request, tenant)
        limiter: Limiter = request.app.state.limiter
        try:
            counted = await limiter.prepare_off_loop(
                tenant=tenant,
                model=parsed.model,
                max_tokens=parsed.max_tokens,  # 0: a count generates nothing
                messages=parsed.messages,
                input_tokens=parsed.input_tokens,
            )
        except InvalidRequest as exc:
            raise BadProxyRequest(400, str(exc)) from None
    except BadProxyRequest as exc:
        return error_response(kind, exc.status, str(exc), param=exc.param)
    return JSONResponse({"input_tokens": counted.input_tokens})


async def _count_upstream(
    proxy: Proxy, upstream: Upstream, request: Request, tenant: str
) -> Response:
    """The upstream's count of the body as the client wrote it, passed back scrubbed;
    its errors as any upstream call's (pool, timeout, the provider's error)."""
    kind = upstream.kind
    outgoing = upstream_request(proxy, upstream, "count_tokens", request, await request.body())
    calls = proxy.metrics.call(kind, "count_tokens")
    try:
        slot = await proxy.shares[upstream.name].acquire(tenant)
    except PoolRefusal as exc:
        return pool_refused(kind, exc, {})
    try:
        response = await proxy.client(upstream).send(outgoing)
        calls.answered(response.status_code)
    except httpx.HTTPError as exc:
        calls.failed(exc)
        return upstream_failed(kind, exc, {})
    finally:
        slot.release()
    if response.status_code >= 400:
        return upstream_error(kind, upstream, response, {})
    return Response(
        upstream.scrub(response.content),
        status_code=response.status_code,
        headers=upstream.scrub_headers(passed_back(response)),
        media_type=response.headers.get("content-type"),
    )
