"""The transport the guarded protocols hand uvicorn: lingering closes, one write per turn.

A server that answers before reading the whole request (413 for a declared
body over the limit, 408 for a body or head too slow, 400 for a broken head)
and then closes its socket while the client's bytes keep arriving makes the
kernel answer those bytes with a reset; the reset discards the answer the
client had not read yet, and the client sees "connection reset by peer"
instead of the status that says why. Web servers close such connections
"lingering" (nginx's `lingering_close`, Apache's `lingering_close()`): send
the answer, shut down the sending half, read and discard what the client
still sends until it closes its side or the lingering time runs out, then
close.

`EdgeTransport` wraps the transport uvicorn's protocol writes to, so
that every close uvicorn makes goes through here; it lingers only when the
protocol says the client may still be sending (a request whose body or head
is unfinished), and closes at once otherwise, so that idle keep-alive
connections close as they always did.

It also gathers the writes of one turn of the event loop into one: uvicorn
writes an answer's head and its body separately, each a `send` system call
of its own, and the two are always made in the same turn. The gathered
bytes go out at the end of that turn (`call_soon`), in order, and before
any close or end of writing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

LINGER_SECONDS = 2.0
"""How long a client that is still sending has to read the answer and close."""
FLUSH_BYTES = 65_536
"""Gathered bytes past which a write goes out at once: a big answer is not held
(nor copied whole) until the turn ends, and uvicorn's flow control sees it."""


class EdgeTransport(asyncio.Transport):
    """The transport a guarded protocol hands uvicorn: close() lingers when it must,
    and the writes of one turn of the loop go out together."""

    def __init__(
        self,
        inner: asyncio.Transport,
        loop: asyncio.AbstractEventLoop,
        client_may_send: Callable[[], bool],
    ) -> None:
        super().__init__()
        self._inner = inner
        self._loop = loop
        self._client_may_send = client_may_send
        self._timer: asyncio.TimerHandle | None = None
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self.lingering = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data or self.is_closing():
            return  # as after a close: what comes then is not sent
        if not self._pending:
            self._loop.call_soon(self._flush)
        # Kept until the end of the turn: a buffer the caller may reuse is copied.
        self._pending.append(data if isinstance(data, bytes) else bytes(data))
        self._pending_bytes += len(data)
        if self._pending_bytes >= FLUSH_BYTES:
            self._flush()  # a big answer goes now, where flow control can see it

    def _flush(self) -> None:
        """Write what this turn gathered, in one call."""
        if not self._pending:
            return
        pending, self._pending, self._pending_bytes = self._pending, [], 0
        if not self.is_closing():
            self._inner.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def close(self) -> None:
        self._flush()
        if self.lingering or self._inner.is_closing():
            return
        if not (self._client_may_send() and self._inner.can_write_eof()):
            self._inner.close()
            return
        self.lingering = True
        self._inner.write_eof()  # FIN once the answer is flushed
        self._inner.resume_reading()  # drain what flow control held back
        self._timer = self._loop.call_later(LINGER_SECONDS, self._inner.close)

    def connection_lost(self) -> None:
        """The connection is gone (the client closed, or the lingering ended)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def is_closing(self) -> bool:
        return self.lingering or self._inner.is_closing()

    def abort(self) -> None:
        self._pending, self._pending_bytes = [], 0
        self._inner.abort()

    def can_write_eof(self) -> bool:
        return self._inner.can_write_eof()

    def write_eof(self) -> None:
        self._flush()
        self._inner.write_eof()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._inner.get_extra_info(name, default)

    def pause_reading(self) -> None:
        self._inner.pause_reading()

    def resume_reading(self) -> None:
        self._inner.resume_reading()

    def is_reading(self) -> bool:
        return self._inner.is_reading()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._inner.set_write_buffer_limits(high, low)

    def get_write_buffer_size(self) -> int:
        return self._inner.get_write_buffer_size() + self._pending_bytes

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._inner.get_write_buffer_limits()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._inner.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._inner.get_protocol()
