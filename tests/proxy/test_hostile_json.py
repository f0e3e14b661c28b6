"""Hostile JSON is a 400 on every endpoint, in the format that endpoint speaks.

100,000 nested `[` (200 KB, under the body limit) made Python's parser raise
RecursionError: a 500 on the proxy endpoints. Now JSON nested deeper than
MAX_JSON_DEPTH is refused as malformed: the provider's error format on the
proxy endpoints, the one error shape on the REST ones. Sent over a real
socket to the real server.
"""

from __future__ import annotations

import httpx
import pytest

from llmquota.domain.json_limits import MAX_JSON_DEPTH
from tests.proxy.conftest import ADMIN, Stack

DEEP = b"[" * 100_000 + b"]" * 100_000


def _nested_object(depth: int) -> bytes:
    """A valid chat body nesting `depth` levels in all: the body object, then a
    chain of objects under `metadata` (a field the proxy passes on unread)."""
    inner = b'"x"'
    for _ in range(depth - 1):
        inner = b'{"a":' + inner + b"}"
    return (
        b'{"model":"gpt-4o-mini","max_tokens":5,'
        b'"messages":[{"role":"user","content":"hi"}],"metadata":' + inner + b"}"
    )


@pytest.mark.parametrize(
    ("path", "error_key"),
    [
        ("/v1/chat/completions", "error"),
        ("/v1/completions", "error"),
        ("/v1/embeddings", "error"),
        ("/v1/messages", "error"),
    ],
)
async def test_deep_json_is_a_provider_format_400_on_every_proxy_endpoint(
    stack: Stack, path: str, error_key: str
) -> None:
    headers = {"Authorization": f"Bearer {stack.key}", "content-type": "application/json"}
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
        answer = await client.post(path, content=DEEP, headers=headers)
        too_deep = await client.post(
            path, content=_nested_object(MAX_JSON_DEPTH + 1), headers=headers
        )
    for response in (answer, too_deep):
        assert response.status_code == 400, response.text
        body = response.json()
        assert "nested deeper than 64" in body[error_key]["message"]
        if path == "/v1/messages":
            assert body["type"] == "error"
            assert body["error"]["type"] == "invalid_request_error"
    assert stack.fake.requests == []  # nothing went upstream


async def test_json_at_the_depth_bound_is_parsed_and_goes_on(stack: Stack) -> None:
    headers = {"Authorization": f"Bearer {stack.key}", "content-type": "application/json"}
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
        answer = await client.post(
            "/v1/chat/completions", content=_nested_object(MAX_JSON_DEPTH), headers=headers
        )
    assert answer.status_code == 200, answer.text
    assert len(stack.fake.requests) == 1


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/admit"),
        ("PUT", "/v1/tenants/acme/policy"),
        ("PUT", "/v1/tenants/acme/quotas/q"),
        ("POST", "/v1/tenants/acme/credits"),
        ("PUT", "/v1/webhooks/w"),
    ],
)
async def test_deep_json_is_a_400_in_the_error_shape_on_the_rest_endpoints(
    stack: Stack, method: str, path: str
) -> None:
    headers = {**ADMIN, "content-type": "application/json"}
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
        answer = await client.request(method, path, content=DEEP, headers=headers)
    assert answer.status_code == 400, answer.text
    body = answer.json()
    assert body["type"] == "error" and body["error"]["type"]
