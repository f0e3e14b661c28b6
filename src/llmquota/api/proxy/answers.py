"""The proxy's answers about an upstream call: the request it sends, and what
the client is told when the call cannot be made or fails (in the provider's
own error format, the provider key scrubbed)."""

from __future__ import annotations

import httpx
from fastapi import Request, Response

from llmquota.api.proxy.pool import PoolRefusal
from llmquota.api.proxy.upstream import PASSED_BACK, UPSTREAM_LIMIT_PREFIXES, Proxy, Upstream
from llmquota.api.proxy.wire import Endpoint, Kind, error_response


def upstream_request(
    proxy: Proxy, upstream: Upstream, endpoint: Endpoint, request: Request, content: bytes
) -> httpx.Request:
    """The upstream request: the body, our key, the provider's own headers."""
    client = proxy.client(upstream)
    return client.build_request(
        "POST",
        upstream.url(endpoint),
        content=content,
        headers=upstream.headers(request.headers),
        timeout=upstream.timeout or client.timeout,
    )


def passed_back(response: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in response.headers.items() if k in PASSED_BACK}


def pool_refused(kind: Kind, exc: PoolRefusal, headers: dict[str, str]) -> Response:
    """No connection to the upstream for this request: nothing was sent, the
    reservation is released by the caller; retry in a second."""
    retry = {"retry-after": "1", "retry-after-ms": "1000"}
    return error_response(kind, exc.status, str(exc), headers={**headers, **retry})


def upstream_failed(
    kind: Kind, exc: httpx.HTTPError | TimeoutError, headers: dict[str, str]
) -> Response:
    """No answer: 504 for a timeout (the upstream's, or the request's deadline), else 502."""
    status = 504 if isinstance(exc, httpx.TimeoutException | TimeoutError) else 502
    reason = "in the request's time" if isinstance(exc, TimeoutError) else type(exc).__name__
    return error_response(kind, status, f"the provider did not answer ({reason})", headers=headers)


def upstream_error(
    kind: Kind, upstream: Upstream, response: httpx.Response, headers: dict[str, str]
) -> Response:
    """A provider's error, passed through (key scrubbed); its 429 with its own headers."""
    if response.status_code in (401, 403):
        return error_response(
            kind, 502, "the provider refused llmquota's credentials; tell the operator"
        )
    passed = {
        k: v
        for k, v in response.headers.items()
        if k.startswith(UPSTREAM_LIMIT_PREFIXES) or k in PASSED_BACK or k == "x-should-retry"
    }
    return Response(
        upstream.scrub(response.content),
        status_code=response.status_code,
        headers={**headers, **upstream.scrub_headers(passed)},
        media_type=response.headers.get("content-type", "application/json"),
    )
