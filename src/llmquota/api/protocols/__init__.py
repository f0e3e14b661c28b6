"""The HTTP/1.1 protocols `llmquota serve` runs: uvicorn's, with a guarded request head.

uvicorn waits for a request head for as long as the client likes (its
keep-alive timeout only runs between requests), and it answers a malformed
head in plain text. A client that opens connections and trickles headers
would hold them forever; a client that gets a 400 would get the one answer
not in the API's error shape. The subclasses here bound the time and size of
every request head and answer in the one error shape (head.py says how).
A connection closed while its client may still be sending (an answer given
before the body was read) closes lingering, so that the client reads the
answer instead of a reset; an answer's head and body go out in one write
(edge_transport.py).

`http_protocol_class()` keeps uvicorn's own choice: httptools when it is
installed, else h11 (`uvicorn.config.HTTP_PROTOCOLS["auto"]`).
"""

from __future__ import annotations

import asyncio
import importlib.util

from llmquota.api.protocols.h11_edge import H11EdgeProtocol
from llmquota.api.protocols.head import HEAD_LIMITS_STATE_KEY, HeadLimits

__all__ = ["HEAD_LIMITS_STATE_KEY", "H11EdgeProtocol", "HeadLimits", "http_protocol_class"]


def http_protocol_class() -> type[asyncio.Protocol]:
    """The guarded protocol for the parser uvicorn would pick itself."""
    if importlib.util.find_spec("httptools") is None:
        return H11EdgeProtocol
    from llmquota.api.protocols.httptools_edge import HttpToolsEdgeProtocol

    return HttpToolsEdgeProtocol
