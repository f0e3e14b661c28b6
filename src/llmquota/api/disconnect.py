"""A client that hangs up: how a waiting request notices, and what it answers."""

from __future__ import annotations

from starlette.types import Receive

# nginx's status for a request whose client closed the connection first: no
# client reads it, but the access log says what happened.
CLIENT_CLOSED_REQUEST = 499


async def client_left(receive: Receive) -> None:
    """Return when the client disconnects.

    The body is read by now, so the next message of the receive channel is
    the disconnect (uvicorn also answers it once the response is sent).
    """
    while (await receive())["type"] != "http.disconnect":
        pass
