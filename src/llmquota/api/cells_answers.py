"""What the front over cells sends: the cells' answers held back and sent
on (or added up), its own refusals, and the request bodies it reads.

The front (cells_front.py) reads a body when it must know its tenant or
send it to several cells; these are its pieces that are not routing.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from starlette.types import Message, Receive, Scope, Send

from llmquota.api.auth import TooManyFailedAuthentications
from llmquota.api.bodylimit import BodyTooLarge, BodyTooSlow
from llmquota.api.errors import send_auth_refusal, send_error
from llmquota.api.provider_errors import proxy_kind, send_provider_error
from llmquota.domain.cells import summed, summed_ceilings

__all__ = [
    "Answer",
    "joined",
    "json_object",
    "refused_if_match",
    "replay",
    "send_summed",
    "send_throttled",
    "tenant_in",
    "whole_body",
]

_DROPPED_HEADERS = frozenset({b"content-length", b"etag"})


@dataclass
class Answer:
    """A cell's whole answer, held back until the front decides to send it."""

    status: int = 500
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""

    async def take(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.headers = list(message.get("headers", []))
        elif message["type"] == "http.response.body":
            self.body += message.get("body", b"")

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    async def send(self, send: Send, body: bytes | None = None, *, etag: bool = True) -> None:
        """Send it on; with `body` in place of its own (its length, no ETag),
        or without its ETag (`etag` False: a cell's own version)."""
        headers = self.headers
        if body is not None:
            headers = [(k, v) for k, v in headers if k.lower() not in _DROPPED_HEADERS]
            headers.append((b"content-length", str(len(body)).encode()))
        elif not etag:
            headers = [(k, v) for k, v in headers if k.lower() != b"etag"]
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        await send({"type": "http.response.body", "body": self.body if body is None else body})


async def refused_if_match(scope: Scope, send: Send) -> bool:
    """Whether the write carried If-Match, and was answered 412: each cell
    versions its own copy or slice, so no one ETag stands for them all."""
    if not any(name == b"if-match" for name, _ in scope["headers"]):
        return False
    await send_error(
        send,
        412,
        "precondition_failed",
        message="If-Match: over cells each cell versions its own copy; write without it",
    )
    return True


async def send_throttled(scope: Scope, send: Send, refused: TooManyFailedAuthentications) -> None:
    """The 429 of a client out of its failed-authentication budget, in the
    provider's format on the proxy's paths."""
    kind = proxy_kind(scope)
    if kind is None:
        await send_auth_refusal(send, refused)
        return
    ms = refused.retry_after_ms
    headers = [
        (b"retry-after", str(-(-ms // 1000)).encode()),
        (b"retry-after-ms", str(ms).encode()),
    ]
    await send_provider_error(send, kind, 429, str(refused), headers=headers)


async def whole_body(receive: Receive, limit: int, seconds: float) -> list[Message] | None:
    """The request's whole body as received; None when the client left.
    BodyTooLarge or BodyTooSlow past `limit` bytes or `seconds` seconds (each
    cell's service's limits): the front never hands on part of a body (a cell
    would read the rest under a fresh deadline, and a shared write reach one
    cell)."""
    messages: list[Message] = []
    size = 0
    try:
        # one deadline for the whole body (not a task per message, as wait_for makes)
        async with asyncio.timeout(seconds):
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return None
                messages.append(message)
                size += len(message.get("body", b""))
                if size > limit:
                    raise BodyTooLarge(limit)
                if not message.get("more_body", False):
                    return messages
    except TimeoutError:
        raise BodyTooSlow(seconds) from None


def replay(messages: list[Message], receive: Receive) -> Callable[[], Awaitable[Message]]:
    """A receive that gives back what was read, then goes on receiving."""
    pending = list(messages)

    async def replayed() -> Message:
        return pending.pop(0) if pending else await receive()

    return replayed


def joined(messages: list[Message]) -> bytes:
    return b"".join(m.get("body", b"") for m in messages if m["type"] == "http.request")


def json_object(content: bytes) -> dict[str, object] | None:
    try:
        parsed = json.loads(content)
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None


def tenant_in(messages: list[Message]) -> str | None:
    """The `tenant` of a JSON body (None: none, or not a body a cell would accept)."""
    parsed = json_object(joined(messages))
    tenant = None if parsed is None else parsed.get("tenant")
    return tenant if isinstance(tenant, str) and tenant else None


async def send_summed(answers: list[Answer], send: Send) -> None:
    """The cells' answers about a shared limit as one: its slices added up."""
    parsed = [json_object(answer.body) for answer in answers]
    if any(p is None for p in parsed):
        await answers[0].send(send)
        return
    bodies = [p for p in parsed if p is not None]
    whole = summed_ceilings(bodies) if "ceilings" in bodies[0] else summed(bodies)
    await answers[0].send(send, json.dumps(whole, separators=(",", ":")).encode())
