"""What both guarded protocols share: the head's limits, its clock, the raw answer.

A request head has `read_timeout_seconds` to arrive whole, counted from its
first byte (or from the connection's opening, for the first request), and at
most `max_bytes`. A head that runs out of time gets 408 if any of it came,
else the connection is closed quietly, as uvicorn closes an idle keep-alive
connection; a head over the size, or one that is not HTTP, gets 400. Both
answers are written by the protocol itself, because no request exists yet to
hand to the application, and both are in the one error shape
(llmquota.api.errors) with a request id of their own, then the connection is
closed: after a broken head nothing on it can be trusted.

The limits come from the application's lifespan state
(`HEAD_LIMITS_STATE_KEY`), which uvicorn hands every protocol instance, so
that the app's Settings govern the server too; without them the Settings
defaults apply.
"""

from __future__ import annotations

import asyncio
import http
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llmquota.api.errors import error_body
from llmquota.api.requestids import new_request_id
from llmquota.config import Settings

HEAD_LIMITS_STATE_KEY = "llmquota.head_limits"
TIMEOUT = 408
BAD_REQUEST = 400

log = logging.getLogger("llmquota.api")


@dataclass(frozen=True, slots=True)
class HeadLimits:
    """How long a request head may take to arrive, and how big it may be."""

    read_timeout_seconds: float
    max_bytes: int

    @classmethod
    def from_settings(cls, settings: Settings) -> HeadLimits:
        return cls(settings.header_read_timeout_seconds, settings.max_header_bytes)

    @classmethod
    def from_state(cls, app_state: Mapping[str, Any]) -> HeadLimits:
        """The limits the app put in its lifespan state, else the defaults."""
        limits = app_state.get(HEAD_LIMITS_STATE_KEY)
        if isinstance(limits, HeadLimits):
            return limits
        fields = Settings.model_fields
        return cls(
            float(fields["header_read_timeout_seconds"].default),
            int(fields["max_header_bytes"].default),
        )


class HeadWatch:
    """The clock and byte count of the request head a connection is waiting for."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, limits: HeadLimits, on_timeout: Callable[[], None]
    ) -> None:
        self.limits = limits
        self.received = 0
        self._loop = loop
        self._on_timeout = on_timeout
        self._timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        """Start the head's clock, unless it runs already."""
        if self._timer is None:
            self._timer = self._loop.call_later(self.limits.read_timeout_seconds, self._expire)

    def count(self, data: bytes) -> None:
        self.received += len(data)

    @property
    def too_large(self) -> bool:
        return self.received > self.limits.max_bytes

    def stop(self) -> None:
        """The head is complete (or the connection is gone): no clock, no count."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.received = 0

    def _expire(self) -> None:
        self._timer = None
        self._on_timeout()


def raw_error(
    status: int,
    error_type: str,
    message: str,
    default_headers: Sequence[tuple[bytes, bytes]] = (),
) -> bytes:
    """A whole HTTP/1.1 error answer in the one error shape, closing the connection.

    The request id is new (no request was parsed to carry one) and is logged
    with the reason, so that an operator can find what a client was told.
    """
    request_id = new_request_id()
    log.info(
        "request %s: answered %d before the request head was read: %s", request_id, status, message
    )
    body = json.dumps(error_body(error_type, request_id=request_id, message=message)).encode()
    lines = [f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}".encode()]
    lines += [name + b": " + value for name, value in default_headers]
    lines += [
        b"content-type: application/json",
        b"content-length: " + str(len(body)).encode(),
        b"x-request-id: " + request_id.encode(),
        b"connection: close",
    ]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def head_timeout_answer(watch: HeadWatch, default_headers: Sequence[tuple[bytes, bytes]]) -> bytes:
    """408 for a head that started and did not finish; nothing for one that never started."""
    if watch.received == 0:
        return b""
    return raw_error(
        TIMEOUT,
        "request_timeout",
        f"the request head was not received within {watch.limits.read_timeout_seconds:g} s",
        default_headers,
    )


def bad_head_answer(
    watch: HeadWatch, too_large: bool, default_headers: Sequence[tuple[bytes, bytes]]
) -> bytes:
    """400 for a head over the size limit, or one that is not HTTP/1.1."""
    message = (
        f"the request head exceeds {watch.limits.max_bytes} bytes"
        if too_large
        else "the request is not valid HTTP/1.1"
    )
    return raw_error(BAD_REQUEST, "invalid_request_error", message, default_headers)
