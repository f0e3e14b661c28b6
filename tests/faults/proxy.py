"""A TCP proxy in front of PostgreSQL that a test can hang or cut.

`pause()` makes the network drop packets: connections stay open, nothing
they send arrives and no answer comes back, and new connections are accepted
but hang in the same way (what a dead switch or a full firewall table looks
like, as opposed to a refused connection). `resume()` brings the network
back; connections that lived through the pause are reset, as a stateful
firewall would, and new ones flow. `cut()` refuses: every connection is
closed and the port stops listening until `restore()`. `freeze()` is a
server that stops (SIGSTOP, a VM paused): nothing it is sent is read and
nothing comes back, but nothing is lost either; at `thaw()` everything sent
meanwhile arrives in order, statements included, and so do their answers
(to whoever is still connected).

It runs in the test's event loop and forwards to the server's unix socket
(or TCP address), so the code under test sees an ordinary TCP server.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlsplit, urlunsplit

CHUNK_BYTES = 65_536


@dataclass(eq=False)
class _Link:
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None
    frozen: bool = False
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def abort(self) -> None:
        for writer in (self.client, self.upstream):
            if writer is not None:
                writer.transport.abort()


class PgProxy:
    """Forwards 127.0.0.1:<port> to the PostgreSQL server of `target_dsn`."""

    def __init__(self, target_dsn: str) -> None:
        parts = urlsplit(target_dsn)
        query = parse_qs(parts.query)
        host = query.get("host", [parts.hostname or "localhost"])[0]
        port = int(query.get("port", [parts.port or 5432])[0])
        self._unix_path = f"{host}/.s.PGSQL.{port}" if host.startswith("/") else None
        self._tcp = (host, port)
        self._target = parts
        self._server: asyncio.Server | None = None
        self._links: set[_Link] = set()
        self._paused = False
        # Cleared while frozen: every pump holds what it read until it is set.
        self._thawed = asyncio.Event()
        self._thawed.set()
        self.port = 0

    @property
    def dsn(self) -> str:
        """The target DSN, rewritten to go through the proxy."""
        user = self._target.username or "postgres"
        password = f":{self._target.password}" if self._target.password else ""
        netloc = f"{user}{password}@127.0.0.1:{self.port}"
        return urlunsplit(("postgresql", netloc, self._target.path, "", ""))

    async def start(self) -> PgProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        await self.cut()

    def pause(self) -> None:
        """Drop every packet from now on, on old and new connections alike."""
        self._paused = True
        for link in self._links:
            link.frozen = True

    def resume(self) -> None:
        """The network is back: reset connections that lived through the pause."""
        self._paused = False
        for link in list(self._links):
            if link.frozen:
                link.abort()

    def freeze(self) -> None:
        """Hold every byte from now on, both ways, on old and new connections."""
        self._thawed.clear()

    def thaw(self) -> None:
        """Deliver everything held, in order, and flow again."""
        self._thawed.set()

    async def cut(self) -> None:
        """Refuse: close every connection and stop listening."""
        if self._server is not None:
            self._server.close()
            for link in list(self._links):
                link.abort()
            await self._server.wait_closed()
            self._server = None

    async def restore(self) -> None:
        """Listen again on the same port."""
        self._paused = False
        await self.start()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link = _Link(client=writer, frozen=self._paused)
        self._links.add(link)
        try:
            if self._unix_path is not None:
                up_reader, up_writer = await asyncio.open_unix_connection(self._unix_path)
            else:
                up_reader, up_writer = await asyncio.open_connection(*self._tcp)
            link.upstream = up_writer
            await asyncio.gather(
                self._pump(link, reader, up_writer), self._pump(link, up_reader, writer)
            )
        except (ConnectionError, OSError):
            pass
        finally:
            self._links.discard(link)
            link.abort()

    async def _pump(
        self, link: _Link, source: asyncio.StreamReader, sink: asyncio.StreamWriter
    ) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while True:
                data = await source.read(CHUNK_BYTES)
                if not data:
                    break
                if link.frozen:
                    continue  # dropped on the floor
                if not self._thawed.is_set():
                    await self._thawed.wait()  # held, as a stopped server's socket holds it
                sink.write(data)
                await sink.drain()
        link.abort()
