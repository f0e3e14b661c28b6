"""Refuse oversized request bodies before anything parses them.

A declared Content-Length over the limit is refused at once; a chunked body
without a length is counted as it streams and cut off the moment it passes
the limit. Either way the client gets 413 and nothing reaches the routes.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmquota.api.errors import send_error

PAYLOAD_TOO_LARGE = 413


class BodyTooLarge(HTTPException):
    """Raised inside receive() when a streamed body passes the limit.

    An HTTPException, so that FastAPI's body parsing lets it through as a 413
    instead of wrapping it into a 400.
    """

    def __init__(self, limit: int) -> None:
        super().__init__(PAYLOAD_TOO_LARGE, f"request body exceeds {limit} bytes")


class BodySizeLimit:
    """ASGI middleware enforcing a maximum request body size."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self._declared_too_large(scope):
            await self._refuse(send)
            return
        seen = 0
        response_started = False

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise BodyTooLarge(self.max_body_bytes)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal response_started
            if message["type"] == "http.response.start":
                response_started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if not response_started:
                await self._refuse(send)

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

    async def _refuse(self, send: Send) -> None:
        await send_error(
            send,
            PAYLOAD_TOO_LARGE,
            "payload_too_large",
            headers=[(b"connection", b"close")],
            message=f"request body exceeds {self.max_body_bytes} bytes",
        )
