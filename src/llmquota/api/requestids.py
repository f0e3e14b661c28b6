"""A request id for every request, and the last word on errors nobody handled.

Every answer carries an `x-request-id` header and every error body its
`request_id` (llmquota.api.errors), while what went wrong inside (an
exception's class and text, a driver's message) goes to the log under the
same id and never into a response: a client learns that something failed
and which request to quote, an operator learns why. An incoming
`x-request-id` is kept when it is a short, plain token (a proxy's or the
client's own trace id), so one id follows a request through every hop; any
other value is replaced, never echoed, since it would land in headers and
logs.

`RequestIds` is the outermost of the app's middlewares, so an exception that
no handler took reaches it while the id is still known: it is logged with
the id and answered with a 500 in the one error shape, instead of the
server's plain-text one.
"""

from __future__ import annotations

import logging
import re
import secrets

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmquota.api.errors import bind_request_id, send_error, unbind_request_id

HEADER = b"x-request-id"
INTERNAL_ERROR = 500
# What an incoming id may look like to be kept: short, and nothing that could
# split a header or a log line.
_SANE_ID = re.compile(rb"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")

log = logging.getLogger("llmquota.api")


def new_request_id() -> str:
    """A fresh id: 96 random bits, hex, prefixed so it reads as what it is."""
    return f"req_{secrets.token_hex(12)}"


def incoming_request_id(scope: Scope) -> str | None:
    """The request's own `x-request-id`, if it is a sane short token."""
    for name, value in scope.get("headers", []):
        if name == HEADER:
            return value.decode("ascii") if _SANE_ID.fullmatch(value) else None
    return None


class RequestIds:
    """ASGI middleware: the id of each request, in its answer, its errors and the log."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = incoming_request_id(scope) or new_request_id()
        header = (HEADER, request_id.encode("ascii"))
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = list(message.get("headers", ()))
                # A proxied answer already carries the provider's own request id,
                # which its SDK reads; ours is then only in the log.
                if not any(name.lower() == HEADER for name, _ in headers):
                    message = {**message, "headers": [*headers, header]}
            await send(message)

        token = bind_request_id(request_id)
        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            log.error(
                "request %s: unhandled %s: %s", request_id, type(exc).__name__, exc, exc_info=exc
            )
            if started:
                raise  # the answer is half out; the server can only close the connection
            await send_error(
                send_with_id,
                INTERNAL_ERROR,
                "api_error",
                headers=[(b"connection", b"close")],
                message="internal error; quote the request id when reporting it",
            )
        finally:
            unbind_request_id(token)
