"""The cheapest HTTP answer uvicorn can give: what `profile_http.py` compares with.

A raw ASGI app that reads the request body and answers 201 with a small
fixed JSON document, run on the same uvicorn, parser, loop and number of
workers as `llmquota serve`: its CPU per request is the server's own floor,
beneath which no admission endpoint on this stack can go.
"""

from __future__ import annotations

from typing import Any

from starlette.types import Receive, Scope, Send

BODY = b'{"reservation_id": "00000000-0000-0000-0000-000000000000", "reserved_tokens": 2013}'
HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode())]


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        return
    more: Any = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 201, "headers": HEADERS})
    await send({"type": "http.response.body", "body": BODY})
