"""Ports for servers that tests start in processes of their own, held for the session.

Drawing a port by binding to port 0 and closing the socket leaves a window,
until the server binds it, in which another process may draw the same port.
CI runs two test sessions side by side, whose same tests start servers at
about the same moments: once, a server of one leg took the port the other
leg had drawn, and that leg's test talked to the wrong server (with another
database) until it stopped. A port drawn here stays bound (SO_REUSEADDR,
never listening) until the session ends, so the kernel gives it to no one
else, while the server it was drawn for, binding with SO_REUSEADDR as
uvicorn and asyncio do, can still bind and listen on it.
"""

from __future__ import annotations

import socket

_held: list[socket.socket] = []


def reserved_port() -> int:
    """A loopback port no other process will be given while this session runs."""
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("127.0.0.1", 0))
    _held.append(holder)
    port: int = holder.getsockname()[1]
    return port
