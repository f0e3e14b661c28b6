"""What the REST client's tests run it against: a real server, and a network that drops.

`LiveServer` is `create_app` under a real uvicorn in a thread of its own,
on a loopback socket, so the blocking client (this thread) and the asyncio
client (the test's loop) both reach it over TCP. `DroppingProxy` forwards
TCP to it and loses the answers to the first admissions: each request
reaches the server, which decides it, and the client's connection is reset
instead of the answer being sent (what a load balancer failing mid-answer
looks like). The recording transports are httpx's own, noting each attempt
the client makes, its timing and what the server answered.
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn

from llmquota.api.app import create_app
from llmquota.config import Settings

ADMIN_KEY = "lq_client_tests_admin_key_0123456789"
START_SECONDS = 60
CHUNK_BYTES = 65_536


@contextlib.contextmanager
def live_server(dsn: str, decision_deadline_ms: int = 60_000) -> Iterator[str]:
    """The API on `dsn`, served by uvicorn in a thread; its base URL.

    The decision deadline is out of the way unless a test wants 503s: on a
    shared 2-core machine a slow decision must stay a decision.
    """
    settings = Settings(  # type: ignore[call-arg]
        _env_file=None,
        admin_key=ADMIN_KEY,
        decision_deadline_ms=decision_deadline_ms,
        pool_min_size=1,
        pool_max_size=4,
    )
    config = uvicorn.Config(
        create_app(settings, dsn=dsn), host="127.0.0.1", port=0, log_level="warning"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + START_SECONDS
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def provision(base: str, tenant: str, **policy: Any) -> str:
    """Give `tenant` a policy and a key (as an admin would, over the API); the key."""
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with httpx.Client(base_url=base, headers=admin) as http:
        http.put(f"/v1/tenants/{tenant}/policy", json=policy).raise_for_status()
        created = http.post(f"/v1/tenants/{tenant}/keys")
        created.raise_for_status()
        return str(created.json()["key"])


def tenant_layer(base: str, tenant: str) -> dict[str, Any]:
    """The tenant's own layer in GET /v1/tenants/{t}/status, as the admin sees it."""
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    status = httpx.get(f"{base}/v1/tenants/{tenant}/status", headers=admin)
    status.raise_for_status()
    (layer,) = [x for x in status.json()["layers"] if x["scope"] == "tenant"]
    return dict(layer)


def usage(base: str, tenant: str) -> dict[str, Any]:
    """The tenant's ledger totals (GET /v1/tenants/{t}/usage, the last 30 days)."""
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    answer = httpx.get(f"{base}/v1/tenants/{tenant}/usage", headers=admin)
    answer.raise_for_status()
    return dict(answer.json())


@dataclass(frozen=True)
class Attempt:
    """One request the client sent, and the answer it got."""

    path: str
    sent_at: float
    answered_at: float
    status: int
    headers: dict[str, str]
    body: dict[str, Any]


def _attempt(request: httpx.Request, sent_at: float, response: httpx.Response) -> Attempt:
    return Attempt(
        request.url.path,
        sent_at,
        time.monotonic(),
        response.status_code,
        dict(response.headers),
        response.json() if response.content else {},
    )


class RecordingTransport(httpx.HTTPTransport):
    """httpx's transport, noting every attempt (for the blocking client)."""

    def __init__(self) -> None:
        super().__init__()
        self.attempts: list[Attempt] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        sent_at = time.monotonic()
        response = super().handle_request(request)
        response.read()
        self.attempts.append(_attempt(request, sent_at, response))
        return response


class AsyncRecordingTransport(httpx.AsyncHTTPTransport):
    """httpx's transport, noting every attempt (for the asyncio client)."""

    def __init__(self) -> None:
        super().__init__()
        self.attempts: list[Attempt] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        sent_at = time.monotonic()
        response = await super().handle_async_request(request)
        await response.aread()
        self.attempts.append(_attempt(request, sent_at, response))
        return response


class DroppingProxy:
    """TCP to the server; the answers to the first `drops` admissions are lost."""

    def __init__(self, base: str, drops: int) -> None:
        self._target = httpx.URL(base)
        self._drops = drops
        self._lock = threading.Lock()
        # The answers the server gave that the client never got (JSON bodies).
        self.dropped: list[dict[str, Any]] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.base = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._listener.close()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = self._listener.accept()
                threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _take_drop(self, request: bytes) -> bool:
        with self._lock:
            if not request.startswith(b"POST /v1/admit ") or self._drops == 0:
                return False
            self._drops -= 1
            return True

    def _serve(self, client: socket.socket) -> None:
        address = (self._target.host, self._target.port or 80)
        with client, socket.create_connection(address) as upstream:
            request = _read_message(client)
            upstream.sendall(request)
            if self._take_drop(request):
                answer = _read_message(upstream)  # the server decided: its answer is lost
                self.dropped.append(json.loads(answer.partition(b"\r\n\r\n")[2]))
                # SO_LINGER 0: close with a reset, as a failing middlebox does.
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                return
            back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
            back.start()
            _pump(client, upstream)
            back.join(timeout=30)


def _read_message(sock: socket.socket) -> bytes:
    """One HTTP/1.1 message with a Content-Length body (what httpx and uvicorn send here)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(CHUNK_BYTES)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    while len(body) < length:
        chunk = sock.recv(CHUNK_BYTES)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def _pump(source: socket.socket, sink: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while chunk := source.recv(CHUNK_BYTES):
            sink.sendall(chunk)
        sink.shutdown(socket.SHUT_WR)
