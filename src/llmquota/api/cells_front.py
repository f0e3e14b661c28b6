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
from dataclasses import dataclass
from typing import Annotated, Any
from urllib.parse import parse_qsl, urlencode

from fastapi import FastAPI
from pydantic import Field, TypeAdapter, ValidationError
from starlette.types import Message, Receive, Scope, Send

from llmquota.admin.ceilings_over_cells import ceiling_alerts_over_cells
from llmquota.admission.heap import settle_after_startup
from llmquota.admission.rebalancer import REBALANCER_LOCK_NAME, SliceRebalancer
from llmquota.api.app import create_app
from llmquota.api.auth import TooManyFailedAuthentications
from llmquota.api.bodylimit import BodyRefused
from llmquota.api.cells_answers import (
    Answer,
    joined,
    json_object,
    refused_if_match,
    replay,
    send_summed,
    send_throttled,
    tenant_in,
    whole_body,
)
from llmquota.api.cells_listing import merged_page, places_of
from llmquota.api.cells_routing import (
    KeyCells,
    StoredAdminKey,
    authorization_of,
    cells_to_ask,
    route_of,
)
from llmquota.api.errors import send_error
from llmquota.api.protocols import HEAD_LIMITS_STATE_KEY, HeadLimits
from llmquota.api.requestids import HEADER, RequestIds, incoming_request_id, new_request_id
from llmquota.api.routes.tenant_directory import DEFAULT_PAGE, MAX_PAGE, encode_cursor
from llmquota.config import Settings
from llmquota.domain.cells import cell_of, sliced_bodies
from llmquota.domain.errors import InvalidRequest
from llmquota.store.cells import CellsError, cells_in, in_cell
from llmquota.store.leader import LeaderLock

__all__ = ["CellsFront", "create_front_from_env"]

log = logging.getLogger(__name__)

REBALANCE_SECONDS = 1.0
# The directory's `limit`, read as its route reads it (routes/tenant_directory.py).
_PAGE_LIMIT = TypeAdapter(Annotated[int, Field(ge=1, le=MAX_PAGE)])


@dataclass
class _Cell:
    name: str
    app: FastAPI
    state: dict[str, Any]


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
        # One shared write at a time in this process, so that two do not
        # interleave cell by cell (docs/scaling.md: across processes they may).
        self._shared_writes = asyncio.Lock()
        # The front's own answers carry the request's id too, as a cell's do.
        self._with_ids = RequestIds(self._answer)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)
        elif scope["type"] == "http":
            await self._serve(scope, receive, send)
        else:
            await self._pass(0, scope, receive, send)

    # -- lifespan ------------------------------------------------------------
    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        await receive()  # lifespan.startup
        try:
            await self.start()
        except Exception as exc:
            log.exception("cells: the service did not start")
            await send({"type": "lifespan.startup.failed", "message": str(exc)})
            return
        if isinstance(scope.get("state"), dict):
            # the server's head limits, as each cell's app would give them
            scope["state"][HEAD_LIMITS_STATE_KEY] = HeadLimits.from_settings(self.settings)
        await send({"type": "lifespan.startup.complete"})
        await receive()  # lifespan.shutdown
        try:
            await self.stop()
        except Exception as exc:
            log.exception("cells: the service did not stop cleanly")
            await send({"type": "lifespan.shutdown.failed", "message": str(exc)})
            return
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
            stores = [cell.app.state.limiter.store for cell in self.cells]
            await self._stack.enter_async_context(ceiling_alerts_over_cells(stores, self.settings))
            lookups = [cell.app.state.admin.find_key for cell in self.cells]
            self.keys = KeyCells(lookups, self.settings)
            self._rebalancer = self._rebalancing()
        except BaseException:
            await self.stop()
            raise
        if self.server_worker:
            settle_after_startup()

    async def stop(self) -> None:
        """Stop rebalancing, then every cell's service (each finishes its work first)."""
        rebalancer, self._rebalancer = self._rebalancer, None
        try:
            if rebalancer is not None:
                await rebalancer.stop()
        finally:
            self.cells = []
            await self._stack.aclose()

    def _settings_in(self, name: str) -> Settings:
        """The settings of one cell's service: its LISTEN DSN names the cell too;
        the front watches the ceilings, whole (admin/ceiling_alerts.py)."""
        listen = self.settings.listen_database_url
        return self.settings.model_copy(
            update={"listen_database_url": in_cell(listen, name) if listen else None}
            | {"ceiling_alerts": False}
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
        """The request, with one id for the front and every cell it reaches
        (theirs is the one it came with, or one made here)."""
        if incoming_request_id(scope) is None:  # none, or one not fit to keep: ours instead
            headers = [(k, v) for k, v in scope["headers"] if k != HEADER]
            scope = dict(scope, headers=[*headers, (HEADER, new_request_id().encode())])
        await self._with_ids(scope, receive, send)

    async def _answer(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._route(scope, receive, send)
        except TooManyFailedAuthentications as refused:  # looking up the key's cell
            await send_throttled(scope, send, refused)
        except StoredAdminKey:
            message = "over cells the admin key is LLMQUOTA_ADMIN_KEY, not one stored in a cell"
            await send_error(send, 403, "permission_error", message=message)
        except BodyRefused as refused:
            headers = [(b"connection", b"close")]
            message = str(refused.detail)
            await send_error(
                send, refused.status_code, refused.error_type, headers=headers, message=message
            )

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = route_of(scope["method"], scope["path"])
        kind = route.kind
        if kind == "tenant" and route.tenant is not None:
            await self._pass(self._cell_of(route.tenant), scope, receive, send)
        elif kind in ("caller", "key", "reservation"):
            await self._by_caller(kind, scope, receive, send)
        elif kind in ("split", "every", "listing", "summed", "first"):
            await self._by_the_admin(kind, scope, receive, send)
        elif kind == "health":
            await self._health(scope, receive, send)
        elif kind == "metrics":
            await self._metrics(scope, receive, send)
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
        cell = await self._cell_of_key(scope)
        if cell is not None:  # a tenant's key (or none: its cell refuses it)
            await self._pass(cell, scope, receive, send)
            return
        if kind == "key":  # the admin key cannot call providers: a cell says so
            await self._pass(0, scope, receive, send)
            return
        body = await self._read_body(receive)
        if body is None:
            return
        if kind == "caller":
            tenant = tenant_in(body)
            cell = 0 if tenant is None else self._cell_of(tenant)
            await self._pass(cell, scope, replay(body, receive), send)
            return
        await self._each_cell_until_found(scope, joined(body), receive, send)

    async def _by_the_admin(self, kind: str, scope: Scope, receive: Receive, send: Send) -> None:
        """What the admin key asks of every cell (shared limits, the tenant
        directory) or of any (plans, webhooks, the documentation). Another key
        goes to the cell that answers it as one database would: a tenant's to
        its own (403), a wrong key or none to cell 1 (401). Sent to every cell,
        a valid tenant key was a failed authentication in each of the others."""
        if kind == "first" and not scope["path"].startswith("/v1/"):  # the documentation
            await self._pass(0, scope, receive, send)
            return
        cell = await self._cell_of_key(scope)
        if kind == "first":  # a plan's or webhook's version is each cell's own: no ETag
            await (await self._call(cell or 0, scope, b"", receive)).send(send, etag=False)
        elif cell is not None:
            await self._pass(cell, scope, receive, send)
        else:
            writes = {"split": self._write_split, "every": self._write_every}
            reads = {"listing": self._list_tenants, "summed": self._read_summed}
            await (writes | reads)[kind](scope, receive, send)

    async def _cell_of_key(self, scope: Scope) -> int | None:
        """The cell that answers the request's key (KeyCells.cell_of)."""
        client = scope["client"][0] if scope.get("client") else ""
        return await self.keys.cell_of(authorization_of(scope["headers"]), client)

    async def _each_cell_until_found(
        self, scope: Scope, content: bytes, receive: Receive, send: Send
    ) -> None:
        """A reservation's request with the admin key, to each cell in turn,
        first the one its id hints at: a cell that does not hold it answers
        404 and changes nothing. A cell that fails (5xx) is passed over; its
        failure is the answer only if no cell holds the reservation."""
        failed: Answer | None = None
        answer = Answer()
        for index in cells_to_ask(scope["path"], len(self.cells)):
            answer = await self._call(index, scope, content, receive)
            if answer.status >= 500:
                failed = failed or answer
            elif answer.status != 404:
                await answer.send(send)
                return
        await (failed or answer).send(send)

    async def _write_split(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A shared limit's write: each cell its slice, smallest first."""
        body = await self._read_body(receive)
        if body is None or await refused_if_match(scope, send):
            return
        parsed = json_object(joined(body))
        if parsed is None:  # a cell refuses it, as one database would
            await self._pass(0, scope, replay(body, receive), send)
            return
        try:
            bodies = sliced_bodies(parsed, len(self.cells))
        except InvalidRequest as exc:
            await send_error(send, 422, "invalid_request_error", message=str(exc))
            return
        answers: list[Answer] = []
        async with self._shared_writes:
            for index in reversed(range(len(self.cells))):
                content = json.dumps(bodies[index]).encode()
                answer = await self._call(index, scope, content, receive)
                if not answer.ok:
                    await answer.send(send)
                    return
                answers.insert(0, answer)
        await send_summed(answers, send)

    async def _write_every(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A write of what every cell holds whole: each cell in order, stopping
        at a refusal; a cell that lacks what is deleted (a retry) is no refusal."""
        body = await self._read_body(receive)
        if body is None or await refused_if_match(scope, send):
            return
        content, done = joined(body), None
        answers = []
        async with self._shared_writes:
            for index in range(len(self.cells)):
                answer = await self._call(index, scope, content, receive)
                if not answer.ok and answer.status != 404:
                    await answer.send(send)
                    return
                answers.append(answer)
                done = done or (answer if answer.ok else None)
        await (done or answers[0]).send(send, etag=False)

    async def _list_tenants(self, scope: Scope, receive: Receive, send: Send) -> None:
        """GET /v1/tenants over cells: each cell's page after its place, merged
        (cells_listing.py). A limit a cell would refuse goes to cell 1 to say so."""
        query = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        given = dict(query)
        try:
            limit = _PAGE_LIMIT.validate_python(given.get("limit", DEFAULT_PAGE))
            places = places_of(given.get("cursor"), len(self.cells))
        except ValidationError:
            message = f"limit: a whole number from 1 to {MAX_PAGE}"
            await send_error(send, 422, "invalid_request_error", message=message)
            return
        except InvalidRequest as exc:
            await send_error(send, 422, "invalid_request_error", message=str(exc))
            return
        kept = [(k, v) for k, v in query if k not in ("cursor", "limit")]
        pages: list[dict[str, Any] | None] = []
        first: Answer | None = None
        for index, place in enumerate(places):
            if place is False:
                pages.append(None)
                continue
            mine = [*kept, ("limit", str(limit))]
            if isinstance(place, str):
                mine.append(("cursor", encode_cursor(place)))
            asked = dict(scope, query_string=urlencode(mine).encode())
            answer = await self._call(index, asked, b"", receive)
            if not answer.ok:
                await answer.send(send)
                return
            first = first or answer
            pages.append(json_object(answer.body))
        page = json.dumps(merged_page(places, pages, limit), separators=(",", ":"))
        assert first is not None  # a cell that is done has answered an earlier page
        await first.send(send, page.encode())

    async def _read_summed(self, scope: Scope, receive: Receive, send: Send) -> None:
        answers = []
        for index in range(len(self.cells)):
            answer = await self._call(index, scope, b"", receive)
            if not answer.ok:
                await answer.send(send)
                return
            answers.append(answer)
        await send_summed(answers, send)

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

    async def _call(self, index: int, scope: Scope, body: bytes, receive: Receive) -> Answer:
        """Cell `index`'s whole answer to the request with `body`, not yet sent."""
        cell, answer, sent = self.cells[index], Answer(), False

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

    async def _read_body(self, receive: Receive) -> list[Message] | None:
        """The request's whole body, within the limits each cell's service applies."""
        limits = self.settings.max_body_bytes, self.settings.body_read_timeout_seconds
        return await whole_body(receive, *limits)


def create_front_from_env() -> CellsFront:
    """Factory for uvicorn workers over cells: everything from LLMQUOTA_* variables."""
    settings = Settings()
    if not settings.database_url:
        raise RuntimeError("no database: set LLMQUOTA_DATABASE_URL")
    return CellsFront(settings, settings.database_url, server_worker=True)
