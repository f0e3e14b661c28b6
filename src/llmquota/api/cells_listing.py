"""The tenant directory over cells: one page from every cell's pages.

GET /v1/tenants pages by keyset on the tenant name, in the database's
collation (routes/tenant_directory.py). Over cells the front asks each cell
for a page after its own place and merges them: each turn takes the
smallest name at the head of a cell's page, so what it takes of each cell is
always a prefix of that cell's page, in that cell's order, whatever the
collation. The next cursor says where each cell stands (after which name,
from its start, or done), so no tenant repeats and none is skipped; a cursor
of one database (one name) is each cell's place. The page is in name order
as Python compares names, which is the database's order when its collation
is C, and close to it otherwise.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from llmquota.api.routes.tenant_directory import decode_cursor
from llmquota.domain.errors import InvalidRequest
from llmquota.domain.names import is_name

__all__ = ["Place", "merged_page", "places_of"]

# Where a cell's listing stands: after a name, from its start (None), or done (False).
Place = str | None | bool

_PREFIX = "cells."
# A cursor names a place per cell: 64 cells of 128-character names, encoded.
MAX_CURSOR_CHARS = 16_384


def places_of(cursor: str | None, cells: int) -> list[Place]:
    """Each cell's place for a request's cursor (InvalidRequest: not one this API made)."""
    if cursor is None:
        return [None] * cells
    if not cursor.startswith(_PREFIX):
        return [decode_cursor(cursor)] * cells
    places: object = None
    raw = cursor[len(_PREFIX) :]
    if len(raw) <= MAX_CURSOR_CHARS:
        try:
            places = json.loads(base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)))
        except (binascii.Error, UnicodeDecodeError, ValueError, RecursionError):
            places = None
    if (
        not isinstance(places, list)
        or len(places) != cells
        or not all(p is None or p is False or (isinstance(p, str) and is_name(p)) for p in places)
        or all(p is False for p in places)  # a listing that is done has no cursor
    ):
        raise InvalidRequest("cursor: not a cursor this API returned")
    return places


def merged_page(
    places: list[Place], pages: list[dict[str, Any] | None], limit: int
) -> dict[str, Any]:
    """The page over cells: `pages[k]` is cell k's answer after `places[k]`
    (None for a cell that is done), each at most `limit` tenants."""
    tenants: list[list[dict[str, Any]]] = [(p or {}).get("tenants", []) for p in pages]
    heads = [0] * len(pages)
    page: list[dict[str, Any]] = []
    while len(page) < limit:
        waiting = [
            (t[h]["tenant"], k)
            for k, (t, h) in enumerate(zip(tenants, heads, strict=True))
            if h < len(t)
        ]
        if not waiting:
            break
        _, k = min(waiting)
        page.append(tenants[k][heads[k]])
        heads[k] += 1
    after: list[Place] = []
    for k, place in enumerate(places):
        more = heads[k] < len(tenants[k]) or (pages[k] or {}).get("next_cursor") is not None
        if place is False or not more:
            after.append(False)
        else:
            after.append(tenants[k][heads[k] - 1]["tenant"] if heads[k] else place)
    done = all(place is False for place in after)
    return {"tenants": page, "next_cursor": None if done else _cursor(after)}


def _cursor(places: list[Place]) -> str:
    encoded = base64.urlsafe_b64encode(json.dumps(places, separators=(",", ":")).encode())
    return _PREFIX + encoded.decode().rstrip("=")
