"""uvicorn's h11 protocol with a guarded request head (see head.py).

h11 tells where a connection is: the client's state is IDLE exactly while
the server waits for a request head, so that is when the clock runs. h11
itself refuses an incomplete head once its buffer passes a bound; the bound
here is the head limit, and a complete head over it (one that arrived in a
single read) is refused by the application (llmquota.api.bodylimit).
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from llmquota.api.protocols.edge_transport import EdgeTransport
from llmquota.api.protocols.head import HeadLimits, HeadWatch, bad_head_answer, head_timeout_answer


class H11EdgeProtocol(H11Protocol):
    """h11 with a clock and a size limit on each request head, and JSON 400s."""

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        limits = HeadLimits.from_state(app_state)
        # Nothing has used the connection object yet: replace it by one whose
        # buffer bound is the head limit instead of h11's 16 KiB.
        self.conn = h11.Connection(h11.SERVER, max_incomplete_event_size=limits.max_bytes)
        self.head = HeadWatch(self.loop, limits, self._head_timed_out)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.linger = EdgeTransport(transport, self.loop, self._client_may_send)
        self.transport = self.linger
        self.head.start()

    def connection_lost(self, exc: Exception | None) -> None:
        self.head.stop()
        self.linger.connection_lost()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.linger.lingering:
            return  # the answer is out: what the client still sends is dropped
        if self.conn.their_state is h11.IDLE:
            self.head.start()
            self.head.count(data)
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self.head.stop()

    def send_400_response(self, msg: str) -> None:
        # h11 fails an incomplete head over its bound with a generic error;
        # the size of what it holds tells that case apart.
        held, _ = self.conn.trailing_data
        too_large = len(held) > self.head.limits.max_bytes
        self.transport.write(
            bad_head_answer(self.head, too_large, self.server_state.default_headers)
        )
        self.transport.close()
        self.head.stop()

    def _client_may_send(self) -> bool:
        """Whether the client may still be sending this request's head or body."""
        return self.head.received > 0 or self.conn.their_state is h11.SEND_BODY

    def _head_timed_out(self) -> None:
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        self.transport.write(head_timeout_answer(self.head, self.server_state.default_headers))
        self.transport.close()
        self.head.stop()
