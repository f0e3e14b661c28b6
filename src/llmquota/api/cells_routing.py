"""Which cell answers a request, for a service over a database of cells.

A tenant lives in the cell its name hashes to (domain/cells.py), so a
request that names its tenant goes there: in its path (`/v1/tenants/{t}/...`),
in its body (an admit or a token count with the admin key), or through its
key (a tenant's key lives in its tenant's cell: which cell knows a digest is
looked up once per process and remembered). A reservation's settle, release
or heartbeat goes to its key's cell; with the admin key it goes to each cell
in turn until one knows the id (docs/scaling.md says what that costs).

A limit no tenant owns is written to every cell: the global policy and the
provider ceilings as K slices (domain/cells.py, `sliced_bodies`), plans
and webhooks whole; reads of them add the slices up. The tenant directory
is every cell's pages merged (cells_listing.py). What has no single cell to
answer it yet (a ceiling's oversubscription, the console, stored admin
keys) is refused with 501 and says so.
"""

from __future__ import annotations

import asyncio
import hmac
import re
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from llmquota.api.auth import (
    AuthenticationFailed,
    KeyLookup,
    TooManyFailedAuthentications,
    bearer_token,
)
from llmquota.api.failures import FailureBudget
from llmquota.api.provider_errors import PROXY_PATHS
from llmquota.config import Settings
from llmquota.domain.cell_hints import hinted_cell
from llmquota.domain.errors import StoreUnavailable
from llmquota.domain.keys import key_digest

__all__ = ["KeyCells", "Route", "StoredAdminKey", "cells_to_ask", "route_of"]

Kind = Literal[
    "tenant",  # the path names the tenant
    "caller",  # the key's tenant, or with the admin key the body's `tenant`
    "key",  # the key's tenant (the proxy: the admin key cannot call providers)
    "reservation",  # the key's cell, or with the admin key each cell in turn
    "split",  # a shared limit's write: each cell its slice
    "listing",  # the tenant directory: every cell's page, merged
    "summed",  # a shared limit's read: the slices added up
    "every",  # a write of what every cell holds whole (plans, webhooks)
    "first",  # what every cell answers alike (plans, webhooks, the OpenAPI document)
    "health",  # every cell must answer
    "metrics",  # one cell's, named by `?cell=`
    "unserved",  # no cell answers it alone yet: 501
]


@dataclass(frozen=True, slots=True)
class Route:
    kind: Kind
    tenant: str | None = None


_TENANT_PATH = re.compile(r"^/v1/tenants/([^/]+)(?:/|$)")
_RESERVATION_PATH = re.compile(r"^/v1/reservations/([^/]+)/(?:settle|release|heartbeat)$")
_SHARED_LIMIT_PATH = re.compile(r"^/v1/(?:policies/global|ceilings/[^/]+)$")
_WHOLE_EVERYWHERE_PATH = re.compile(r"^/v1/(?:plans|webhooks)(?:/[^/]+)?$")
_READS = frozenset({"GET", "HEAD"})


# Paths answered by one rule whatever they name; reads of listings over cells.
_FIXED: dict[str, Kind] = {
    **dict.fromkeys(PROXY_PATHS, "key"),
    "/v1/admit": "caller",
    "/v1/tokens/count": "caller",
    **dict.fromkeys(("/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"), "first"),
    "/healthz": "health",
    "/metrics": "metrics",
}
_LISTINGS: dict[str, Kind] = {"/v1/tenants": "listing", "/v1/ceilings": "summed"}


def route_of(method: str, path: str) -> Route:
    """How the request `method path` finds its cell."""
    tenant = _TENANT_PATH.match(path)
    if tenant is not None:
        return Route("tenant", tenant.group(1))
    fixed = _FIXED.get(path.rstrip("/") if path != "/" else path)
    if fixed is not None:
        return Route(fixed)
    if method in _READS and path in _LISTINGS:
        return Route(_LISTINGS[path])
    if _RESERVATION_PATH.match(path):
        return Route("reservation")
    if _SHARED_LIMIT_PATH.match(path):
        if method in _READS:
            return Route("summed")
        return Route("split" if method in ("PUT", "PATCH") else "every")
    if _WHOLE_EVERYWHERE_PATH.match(path):
        return Route("first" if method in _READS else "every")
    return Route("unserved")


def cells_to_ask(path: str, cells: int) -> list[int]:
    """The order in which a reservation's request with the admin key asks the
    cells: first the one its id hints at (domain/cell_hints.py), then the
    others in order. An id that is not a UUID gives no hint."""
    found = _RESERVATION_PATH.match(path)
    try:
        first = hinted_cell(uuid.UUID(found.group(1)), cells) if found else 0
    except ValueError:
        first = 0
    return [first, *(index for index in range(cells) if index != first)]


def authorization_of(headers: Sequence[tuple[bytes, bytes]]) -> str | None:
    """The request's key as an `Authorization` value: the header, or the
    anthropic SDK's `x-api-key` (as the proxy reads it)."""
    authorization = api_key = None
    for name, value in headers:
        if name == b"authorization":
            authorization = value.decode("latin-1")
        elif name == b"x-api-key":
            api_key = value.decode("latin-1")
    if api_key and not (authorization or "").lower().startswith("bearer "):
        return f"Bearer {api_key}"
    return authorization


# Keys remembered per process; past this many the memory starts again.
MAX_KEYS = 100_000
# What KeyCells remembers for an admin key stored in a cell.
_STORED_ADMIN = -1


class StoredAdminKey(Exception):
    """An admin key stored in one cell (made by a service of that cell alone):
    it would write a shared limit whole into that cell, or decide another
    cell's tenant there. Over cells the admin key is LLMQUOTA_ADMIN_KEY."""


class KeyCells:
    """Which cell holds each key this process has seen (a key never moves: its
    tenant's cell is fixed), or that a key is the admin's.

    A digest is looked up in each cell once, however many requests carry it
    at once. A digest no cell holds is remembered as such for the key cache's
    negative window, and so is an admin key a cell stores (refused here, so no
    cell's answer would tell of its revocation: looked up again after the
    window, a revoked one is then a key no cell holds, 401). Each lookup is
    paid for from its client's failed-authentication budget first and paid
    back when a cell holds the key (as Authenticator does): a client out of
    that budget is refused here, before any lookup, and a flood of wrong keys
    cannot overdraw it."""

    def __init__(self, lookups: Sequence[KeyLookup], settings: Settings) -> None:
        self._lookups = lookups
        self._admin = key_digest(settings.admin_key) if settings.admin_key else None
        self._cells: dict[bytes, int] = {}
        self._unknown: dict[bytes, float] = {}  # digest -> until when no cell holds it
        self._stored_admin: dict[bytes, float] = {}  # digest -> until when it is one
        self._unknown_seconds = settings.key_negative_cache_seconds
        self._running: dict[bytes, asyncio.Task[tuple[int, bool]]] = {}
        self._failures = FailureBudget(
            settings.auth_failures_per_second, settings.auth_failure_burst
        )

    async def cell_of(self, authorization: str | None, client: str) -> int | None:
        """The cell (0-based) whose service answers this key: the one that holds
        it; cell 0 for a key none holds (it answers 401) or whose lookup
        failed (503); None for the admin key (any cell knows it: the request
        says where it goes). TooManyFailedAuthentications for a client whose
        unknown keys have used up its budget; StoredAdminKey for an admin key
        a cell holds."""
        digest = _digest(authorization)
        if digest is None:
            return 0
        if self._admin is not None and hmac.compare_digest(digest, self._admin):
            return None
        known = self._cells.get(digest)
        if known is not None:
            return known
        now = time.monotonic()
        if self._stored_admin.get(digest, 0.0) > now:
            raise StoredAdminKey
        if self._unknown.get(digest, 0.0) > now:
            return 0
        running = self._running.get(digest)
        pays = running is None  # a request joining a lookup under way costs none
        if running is None:
            # Paid before the lookup, paid back if a cell holds the key: many
            # wrong keys at once cannot overdraw the budget.
            retry_after_ms = self._failures.spend(client, now)
            if retry_after_ms is not None:
                raise TooManyFailedAuthentications(retry_after_ms)
            running = self._running[digest] = asyncio.create_task(self._look_up(digest))
            running.add_done_callback(lambda _t: self._running.pop(digest, None))
        cell, found = await asyncio.shield(running)
        if found and pays:
            self._failures.refund(client, time.monotonic())
        if cell == _STORED_ADMIN:
            raise StoredAdminKey
        return cell

    async def _look_up(self, digest: bytes) -> tuple[int, bool]:
        """(the cell that answers the key, whether it holds it). None holds it:
        cell 0, remembered a while; unless a cell did not answer: that cell,
        whose service meets the same outage and says so (503)."""
        failed: int | None = None
        for cell, lookup in enumerate(self._lookups):
            try:
                owner = await lookup(digest)
            except StoreUnavailable:
                failed = cell if failed is None else failed
                continue
            if owner is not None and owner.tenant is None:
                if len(self._stored_admin) >= MAX_KEYS:
                    self._stored_admin.clear()
                self._stored_admin[digest] = time.monotonic() + self._unknown_seconds
                return _STORED_ADMIN, True
            if owner is not None:
                if len(self._cells) >= MAX_KEYS:
                    self._cells.clear()
                self._cells[digest] = cell
                return cell, True
        if failed is not None:
            return failed, False
        if len(self._unknown) >= MAX_KEYS:
            self._unknown.clear()
        self._unknown[digest] = time.monotonic() + self._unknown_seconds
        return 0, False


def _digest(authorization: str | None) -> bytes | None:
    try:
        return key_digest(bearer_token(authorization))
    except AuthenticationFailed:
        return None
