"""uvicorn's httptools protocol with a guarded request head (see head.py).

The parser's callbacks say where a connection is: a head is awaited from the
connection's opening and from the end of each request's body, until the
parser reports the head complete. A head awaited while an answer is still
being written (a pipelined request) starts no clock: uvicorn's keep-alive
timeout covers the connection once the answer is out. The parser has no
size limit of its own, so the bytes of an awaited head are counted here; a
complete head over the limit that arrived in one read is refused by the
application (llmquota.api.bodylimit).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from llmquota.api.protocols.edge_transport import EdgeTransport
from llmquota.api.protocols.head import HeadLimits, HeadWatch, bad_head_answer, head_timeout_answer


class HttpToolsEdgeProtocol(HttpToolsProtocol):
    """httptools with a clock and a size limit on each request head, and JSON 400s."""

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.head = HeadWatch(self.loop, HeadLimits.from_state(app_state), self._head_timed_out)
        self.awaiting_head = True

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
        watched = self.awaiting_head and not self._answering()
        if watched:
            self.head.start()
            self.head.count(data)
        super().data_received(data)
        over = watched and self.awaiting_head and self.head.too_large
        if over and not self.transport.is_closing():
            self._refuse(too_large=True)

    def on_headers_complete(self) -> None:
        self.awaiting_head = False
        self.head.stop()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self.awaiting_head = True

    def send_400_response(self, msg: str) -> None:
        self._refuse(too_large=False)

    def _refuse(self, *, too_large: bool) -> None:
        self.transport.write(
            bad_head_answer(self.head, too_large, self.server_state.default_headers)
        )
        self.transport.close()
        self.head.stop()

    def _client_may_send(self) -> bool:
        """Whether the client may still be sending this request's head or body."""
        # Between a head and the end of its body (awaiting_head is False) the body
        # may still be coming, even when the answer went out first.
        return self.head.received > 0 or not self.awaiting_head

    def _answering(self) -> bool:
        """Whether an answer to an earlier request is still being written."""
        return self.cycle is not None and not self.cycle.response_complete

    def _head_timed_out(self) -> None:
        if self.transport.is_closing() or not self.awaiting_head or self._answering():
            return
        self.transport.write(head_timeout_answer(self.head, self.server_state.default_headers))
        self.transport.close()
        self.head.stop()
