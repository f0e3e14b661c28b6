"""The service over a database of cells: an app per cell, and a front that
sends each request to the cell that answers it.

`llmquota serve` at the `public` DSN of a database built with `llmquota
migrate --cells K` runs this front. Each cell gets the whole service as one
database has it (app.py at the cell's DSN: its pool, its coalescer, its
caches, its sweeper, its webhook delivery, its fair share), so every
statement of a request is one cell's, and on Citus runs on that cell's node.
The front adds no statement of its own to a request that names its tenant
or carries a key it has seen; cells_routing.py says which cell that is.

A write of a shared limit goes to each cell with its slice, smallest slices
first (what one cell refuses, it refuses before any cell is written); a read
of one adds the slices up. The shared slices are rebalanced by this process
while it holds the rebalancer's lock (admission/rebalancer.py), as the
library's CellLimiters does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from starlette.types import Message, Receive, Scope, Send

from llmquota.admission.heap import settle_after_startup
from llmquota.admission.rebalancer import REBALANCER_LOCK_NAME, SliceRebalancer
from llmquota.api.app import create_app
from llmquota.api.cells_routing import KeyCells, authorization_of, route_of
from llmquota.api.errors import send_error
from llmquota.config import Settings
from llmquota.domain.cells import cell_of, sliced_bodies, summed
from llmquota.domain.errors import InvalidRequest
from llmquota.store.cells import CellsError, cells_in, in_cell
from llmquota.store.leader import LeaderLock

__all__ = ["CellsFront", "create_front_from_env"]

log = logging.getLogger(__name__)

REBALANCE_SECONDS = 1.0
_DROPPED_HEADERS = frozenset({b"content-length", b"etag"})


@dataclass
class _Cell:
    name: str
    app: FastAPI
    state: dict[str, Any]


@dataclass
class _Answer:
    """A cell's whole answer, held back until the front decides to send it."""

    status: int = 500
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""

    async def take(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.headers = list(message.get("headers", []))
        elif message["type"] == "http.response.body":
            self.body += message.get("body", b"")

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    async def send(self, send: Send, body: bytes | None = None) -> None:
        headers = self.headers
        if body is not None:
            headers = [(k, v) for k, v in headers if k.lower() not in _DROPPED_HEADERS]
            headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        await send({"type": "http.response.body", "body": self.body if body is None else body})


class CellsFront:
    """The ASGI app of a service over cells."""

    def __init__(self, settings: Settings, dsn: str, *, server_worker: bool = False) -> None:
        self.settings = settings
        self.dsn = dsn
        self.server_worker = server_worker
        self.cells: list[_Cell] = []
        self.keys = KeyCells([], settings)
        self._stack = contextlib.AsyncExitStack()
        self._rebalancer: SliceRebalancer | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._serve(scope, receive, send)
        else:
            await self._pass(0, scope, receive, send)

    # -- lifespan ------------------------------------------------------------
    async def _lifespan(self, receive: Receive, send: Send) -> None:
        await receive()  # lifespan.startup
        try:
            await self.start()
        except Exception as exc:
            log.exception("cells: the service did not start")
            await send({"type": "lifespan.startup.failed", "message": str(exc)})
            return
        await send({"type": "lifespan.startup.complete"})
        await receive()  # lifespan.shutdown
        try:
            await self.stop()
        finally:
            await send({"type": "lifespan.shutdown.complete"})

    async def start(self) -> None:
        """Start every cell's service (all of them, or none), then the rebalancer."""
        names = await cells_in(self.dsn)
        if not names:
            raise CellsError("no cells: build them with `llmquota migrate --cells K` first")
        try:
            for name in names:
                app = create_app(self._settings_in(name), in_cell(self.dsn, name))
                state = await self._stack.enter_async_context(app.router.lifespan_context(app))
                self.cells.append(_Cell(name, app, dict(state or {})))
        except BaseException:
            await self.stop()
            raise
        self.keys = KeyCells([cell.app.state.admin.find_key for cell in self.cells], self.settings)
        self._rebalancer = self._rebalancing()
        if self.server_worker:
            settle_after_startup()

    async def stop(self) -> None:
        """Stop rebalancing, then every cell's service (each finishes its work first)."""
        if self._rebalancer is not None:
            await self._rebalancer.stop()
        await self._stack.aclose()
        self.cells = []

    def _settings_in(self, name: str) -> Settings:
        """The settings of one cell's service: its LISTEN DSN names the cell too."""
        listen = self.settings.listen_database_url
        return self.settings.model_copy(
            update={"listen_database_url": in_cell(listen, name) if listen else None}
        )

    def _rebalancing(self) -> SliceRebalancer | None:
        """The rebalancer, started; None without a direct DSN for its lock."""
        target = self.settings.listen_database_url or (
            None if self.settings.transaction_pooler else self.dsn
        )
        if target is None:
            log.warning(
                "cells: no direct DSN for the rebalancer's lock behind a transaction pooler "
                "(set LLMQUOTA_LISTEN_DATABASE_URL); run `llmquota rebalance --loop 1`"
            )
            return None
        limiters = {cell.name: cell.app.state.limiter for cell in self.cells}
        rebalancer = SliceRebalancer(
            [(name, limiter.store.budget_moves) for name, limiter in limiters.items()],
            REBALANCE_SECONDS,
            credited=lambda name: limiters[name].refusals.forget_all(),
            leader=LeaderLock(target, REBALANCER_LOCK_NAME),
        )
        rebalancer.start()
        return rebalancer

    # -- requests ------------------------------------------------------------
    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = route_of(scope["method"], scope["path"])
        kind = route.kind
        if kind == "tenant" and route.tenant is not None:
            await self._pass(self._cell_of(route.tenant), scope, receive, send)
        elif kind in ("caller", "key", "reservation"):
            await self._by_caller(kind, scope, receive, send)
        elif kind == "split":
            await self._write_split(scope, receive, send)
        elif kind == "every":
            await self._write_every(scope, receive, send)
        elif kind == "summed":
            await self._read_summed(scope, receive, send)
        elif kind == "health":
            await self._health(scope, receive, send)
        elif kind == "metrics":
            await self._metrics(scope, receive, send)
        elif kind == "first":
            await self._pass(0, scope, receive, send)
        else:
            await send_error(
                send,
                501,
                "not_served_over_cells",
                message=f"{scope['method']} {scope['path']} is not served over cells yet: ask "
                "the service of one cell (its DSN with search_path=cell_k); docs/scaling.md",
            )

    def _cell_of(self, tenant: str) -> int:
        return cell_of(tenant, len(self.cells)) - 1

    async def _pass(self, index: int, scope: Scope, receive: Receive, send: Send) -> None:
        """The request to cell `index`'s service, as it came."""
        cell = self.cells[index]
        await cell.app(dict(scope, state=dict(cell.state)), receive, send)

    async def _by_caller(self, kind: str, scope: Scope, receive: Receive, send: Send) -> None:
        """A tenant's key goes to its cell; the admin key by the body's tenant
        (admit, count) or to each cell in turn (a reservation)."""
        authorization = authorization_of(scope["headers"])
        if not self.keys.is_admin(authorization):
            client = scope["client"][0] if scope.get("client") else ""
            await self._pass(await self.keys.cell_of(authorization, client), scope, receive, send)
            return
        if kind == "key":  # the admin key cannot call providers: a cell says so
            await self._pass(0, scope, receive, send)
            return
        body, whole = await self._read_body(receive)
        replayed = _replay(body, receive)
        if kind == "caller" or not whole:
            tenant = _tenant_in(body) if whole else None
            cell = 0 if tenant is None else self._cell_of(tenant)
            await self._pass(cell, scope, replayed, send)
            return
        content = _joined(body)
        for index in range(len(self.cells) - 1):
            answer = await self._call(index, scope, content, receive)
            if answer.status != 404:
                await answer.send(send)
                return
        await self._pass(len(self.cells) - 1, scope, replayed, send)

    async def _write_split(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A shared limit's write: each cell its slice, smallest first."""
        body, whole = await self._read_body(receive)
        parsed = _json_object(_joined(body)) if whole else None
        if parsed is None:  # a cell refuses it, as one database would
            await self._pass(0, scope, _replay(body, receive), send)
            return
        try:
            bodies = sliced_bodies(parsed, len(self.cells))
        except InvalidRequest as exc:
            await send_error(send, 422, "invalid_request_error", message=str(exc))
            return
        answers: list[_Answer] = []
        for index in reversed(range(len(self.cells))):
            answer = await self._call(index, scope, json.dumps(bodies[index]).encode(), receive)
            if not answer.ok:
                await answer.send(send)
                return
            answers.insert(0, answer)
        await _send_summed(answers, send)

    async def _write_every(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A write of what every cell holds whole: each cell in order, stopping
        at a refusal; a cell that lacks what is deleted (a retry) is no refusal."""
        body, whole = await self._read_body(receive)
        if not whole:
            await self._pass(0, scope, _replay(body, receive), send)
            return
        content, first_done = _joined(body), None
        answers = []
        for index in range(len(self.cells)):
            answer = await self._call(index, scope, content, receive)
            if not answer.ok and answer.status != 404:
                await answer.send(send)
                return
            answers.append(answer)
            first_done = first_done or (answer if answer.ok else None)
        await (first_done or answers[0]).send(send)

    async def _read_summed(self, scope: Scope, receive: Receive, send: Send) -> None:
        answers = []
        for index in range(len(self.cells)):
            answer = await self._call(index, scope, b"", receive)
            if not answer.ok:
                await answer.send(send)
                return
            answers.append(answer)
        await _send_summed(answers, send)

    async def _health(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Healthy when every cell is: the first cell's answer, or the first failing one."""
        answers = [await self._call(i, scope, b"", receive) for i in range(len(self.cells))]
        await next((a for a in answers if not a.ok), answers[0]).send(send)

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        """One cell's metrics (`/metrics?cell=cell_2`): each cell's service
        counts its own, and two registries' families would collide in one page."""
        query = scope.get("query_string", b"").decode("latin-1")
        names = [cell.name for cell in self.cells]
        wanted = dict(p.partition("=")[::2] for p in query.split("&") if p).get("cell")
        if wanted in names:
            await self._pass(names.index(wanted), scope, receive, send)
            return
        await send_error(
            send,
            501,
            "not_served_over_cells",
            message=f"metrics are per cell over cells: /metrics?cell= one of {', '.join(names)}",
        )

    async def _call(self, index: int, scope: Scope, body: bytes, receive: Receive) -> _Answer:
        """Cell `index`'s whole answer to the request with `body`, not yet sent."""
        cell, answer, sent = self.cells[index], _Answer(), False

        async def once() -> Message:
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await cell.app(dict(scope, headers=headers, state=dict(cell.state)), once, answer.take)
        return answer

    async def _read_body(self, receive: Receive) -> tuple[list[Message], bool]:
        """The request's body as received, and whether it is whole: a body over
        the size limit, or slower than the read timeout, is passed on as far
        as it was read (the cell's request limits answer it)."""
        deadline = asyncio.get_running_loop().time() + self.settings.body_read_timeout_seconds
        messages: list[Message] = []
        size = 0
        try:
            # one deadline for the whole body (not a task per message, as wait_for makes)
            async with asyncio.timeout_at(deadline):
                while True:
                    message = await receive()
                    messages.append(message)
                    if message["type"] != "http.request":
                        return messages, False
                    size += len(message.get("body", b""))
                    if size > self.settings.max_body_bytes:
                        return messages, False
                    if not message.get("more_body", False):
                        return messages, True
        except TimeoutError:
            return messages, False


def _replay(messages: list[Message], receive: Receive) -> Callable[[], Awaitable[Message]]:
    """A receive that gives back what was read, then goes on receiving."""
    pending = list(messages)

    async def replayed() -> Message:
        return pending.pop(0) if pending else await receive()

    return replayed


def _joined(messages: list[Message]) -> bytes:
    return b"".join(m.get("body", b"") for m in messages if m["type"] == "http.request")


def _json_object(content: bytes) -> dict[str, object] | None:
    try:
        parsed = json.loads(content)
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None


def _tenant_in(messages: list[Message]) -> str | None:
    """The `tenant` of a JSON body (None: none, or not a body a cell would accept)."""
    parsed = _json_object(_joined(messages))
    tenant = None if parsed is None else parsed.get("tenant")
    return tenant if isinstance(tenant, str) and tenant else None


async def _send_summed(answers: list[_Answer], send: Send) -> None:
    """The cells' answers about a shared limit as one: its slices added up."""
    parsed = [_json_object(answer.body) for answer in answers]
    if any(p is None for p in parsed):
        await answers[0].send(send)
        return
    whole = summed([p for p in parsed if p is not None])
    await answers[0].send(send, json.dumps(whole, separators=(",", ":")).encode())


def create_front_from_env() -> CellsFront:
    """Factory for uvicorn workers over cells: everything from LLMQUOTA_* variables."""
    settings = Settings()
    if not settings.database_url:
        raise RuntimeError("no database: set LLMQUOTA_DATABASE_URL")
    return CellsFront(settings, settings.database_url, server_worker=True)
