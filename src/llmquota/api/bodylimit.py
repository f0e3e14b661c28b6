"""Refuse request heads and bodies that are too big, and bodies that are too slow.

A declared Content-Length over the limit is refused at once; a chunked body
without a length is counted as it streams and cut off the moment it passes
the limit. Either way the client gets 413 and nothing reaches the routes.

A body must arrive whole within `read_timeout_seconds` of the moment the app
first asks for it (one deadline for the whole body, not per read, so that a
trickle of bytes cannot keep a request, and what it holds, alive): past it
the client gets 408 and the connection is closed.

On the proxy paths these answers are in the provider's format (413 with
`x-should-retry: false`, which the SDKs read as "never retry"), elsewhere in
llmquota's own (llmquota.api.provider_errors).

A request head over `max_head_bytes` gets 400. The server protocol
(llmquota.api.protocols) refuses a head that grows past the limit while it
is still arriving; a head that arrived whole in one read reaches the app,
and is refused here, with the same answer.
"""

from __future__ import annotations

import asyncio

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmquota.api.errors import send_error
from llmquota.api.provider_errors import proxy_kind, send_provider_error

BAD_REQUEST = 400
REQUEST_TIMEOUT = 408
PAYLOAD_TOO_LARGE = 413
_CLOSE = {"connection": "close"}


class BodyRefused(HTTPException):
    """Raised inside receive() when the body may not be read on.

    An HTTPException, so that FastAPI's body parsing lets it through with its
    status instead of wrapping it into a 400.
    """

    error_type = "http_error"


class BodyTooLarge(BodyRefused):
    """A streamed body passed the limit."""

    error_type = "payload_too_large"

    def __init__(self, limit: int) -> None:
        super().__init__(PAYLOAD_TOO_LARGE, f"request body exceeds {limit} bytes")


class BodyTooSlow(BodyRefused):
    """The body did not arrive whole within the read timeout."""

    error_type = "request_timeout"

    def __init__(self, seconds: float) -> None:
        message = f"the request body was not received within {seconds:g} s"
        super().__init__(REQUEST_TIMEOUT, message, headers=_CLOSE)


def head_bytes(scope: Scope) -> int:
    """About the size of the request head: request line and header lines."""
    size = len(scope.get("method", "")) + len(scope.get("raw_path") or b"") + 12
    size += len(scope.get("query_string", b"")) + 1
    return size + sum(len(name) + len(value) + 4 for name, value in scope.get("headers", []))


class RequestLimits:
    """ASGI middleware bounding the head's size and the body's size and time."""

    def __init__(
        self,
        app: ASGIApp,
        max_body_bytes: int,
        max_head_bytes: int,
        read_timeout_seconds: float,
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_head_bytes = max_head_bytes
        self.read_timeout_seconds = read_timeout_seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if head_bytes(scope) > self.max_head_bytes:
            await self._refuse_head(scope, send)
            return
        if self._declared_too_large(scope):
            await self._refuse(scope, send, BodyTooLarge(self.max_body_bytes))
            return
        response_started = False

        async def tracking_send(message: Message) -> None:
            nonlocal response_started
            if message["type"] == "http.response.start":
                response_started = True
            await send(message)

        try:
            await self.app(scope, self._limited(receive), tracking_send)
        except BodyRefused as refused:
            if not response_started:
                await self._refuse(scope, send, refused)

    def _limited(self, receive: Receive) -> Receive:
        """`receive` with the body's size limit and its deadline."""
        seen = 0
        deadline: float | None = None
        complete = False

        async def limited_receive() -> Message:
            nonlocal seen, deadline, complete
            if complete:
                # Past the body only a disconnect can come: no deadline on it.
                return await receive()
            if deadline is None:
                deadline = asyncio.get_running_loop().time() + self.read_timeout_seconds
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise BodyTooSlow(self.read_timeout_seconds) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                complete = True
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise BodyTooLarge(self.max_body_bytes)
            return message

        return limited_receive

    def _declared_too_large(self, scope: Scope) -> bool:
        """A Content-Length over the limit (or not a number) is refused unread."""
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    return True
                return declared < 0 or declared > self.max_body_bytes
        return False

    async def _refuse(self, scope: Scope, send: Send, refused: BodyRefused) -> None:
        close = (b"connection", b"close")
        kind = proxy_kind(scope)
        if kind is not None:
            # A body that is too large stays too large: the SDKs must not retry it.
            extra = [(b"x-should-retry", b"false")] if refused.status_code == 413 else []
            await send_provider_error(
                send, kind, refused.status_code, refused.detail, headers=[close, *extra]
            )
            return
        await send_error(
            send,
            refused.status_code,
            refused.error_type,
            headers=[close],
            message=refused.detail,
        )

    async def _refuse_head(self, scope: Scope, send: Send) -> None:
        message = f"the request head exceeds {self.max_head_bytes} bytes"
        close = (b"connection", b"close")
        kind = proxy_kind(scope)
        if kind is not None:
            await send_provider_error(send, kind, BAD_REQUEST, message, headers=[close])
            return
        await send_error(
            send, BAD_REQUEST, "invalid_request_error", headers=[close], message=message
        )
