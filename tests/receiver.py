"""A real webhook receiver for the alert tests: a tiny ASGI app on uvicorn, on a socket.

It records every POST it answers (event id header, signature header, raw
body), can answer with a failure status for a while, hold each request for
a delay, or be stopped and started again on the same port (down, then back).
It checks nothing itself: the tests verify the signatures with the secret.
"""

from __future__ import annotations

import asyncio
import json
import socket
from dataclasses import dataclass, field
from typing import Any

import uvicorn

from llmquota.domain.alerts import verify_signature


@dataclass
class Received:
    """One POST as the receiver got it."""

    event_id: str
    signature: str
    body: bytes
    status: int
    host: str = ""

    def json(self) -> dict[str, Any]:
        loaded: dict[str, Any] = json.loads(self.body)
        return loaded


@dataclass
class Receiver:
    """A webhook receiver on 127.0.0.1:<port>."""

    port: int = 0
    status: int = 200
    delay_seconds: float = 0.0
    received: list[Received] = field(default_factory=list)
    started_requests: int = 0
    _server: uvicorn.Server | None = None
    _task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the sender died mid-body (kill -9): nothing was delivered
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.started_requests += 1
        if self.delay_seconds:
            await asyncio.sleep(self.delay_seconds)
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        status = self.status
        self.received.append(
            Received(
                headers.get("llmquota-event-id", ""),
                headers.get("llmquota-signature", ""),
                body,
                status,
                headers.get("host", ""),
            )
        )
        start = {"type": "http.response.start", "status": status}
        await send({**start, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})

    async def start(self) -> Receiver:
        """Listen (on the same port as before, after a stop)."""
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._task = asyncio.ensure_future(self._server.serve(sockets=[sock]))
        while not self._server.started:
            assert not self._task.done(), "receiver did not start"
            await asyncio.sleep(0.01)
        return self

    async def stop(self) -> None:
        """Stop listening: connections are refused until start() again."""
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task
            self._server = self._task = None

    def delivered(self) -> list[Received]:
        """The POSTs answered with a 2xx."""
        return [r for r in self.received if 200 <= r.status < 300]

    def delivered_ids(self) -> list[str]:
        return [r.event_id for r in self.delivered()]

    def all_signed(self, secret: str) -> bool:
        """Whether every POST carries a valid signature of its body under `secret`."""
        return all(verify_signature(secret, r.signature, r.body) for r in self.received)
