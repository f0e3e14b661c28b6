"""Reservation ids that say which cell made them, so a settle is sent there first.

A database of cells (docs/scaling.md, Cells) keeps each reservation in its
tenant's cell. A settle, release or heartbeat that carries a tenant's key
goes to that key's cell. One that carries the admin key names only the
reservation, so the front (api/cells_front.py) asked each cell in turn until
one held it: a 404 from every cell before that one, and for an id made by a
slice a journal interval's wait in each (slice_ids.py).

So every id a cell's service makes carries the cell's index in six of its
random bits: bits 64-69 of the 128 (the low six bits of byte 7). Those bits
are random in all three forms of id a worker makes: version 4 (the exact
path's, admission/recovery.py), version 7 (a slice's) and version 8 (an
outage's, signed after the hint is set). The front asks the hinted cell
first and the others only if that one does not hold the id, so the hint
only ever saves work: an id made without one (six random bits) costs what
it did before, and a wrong hint costs one extra 404.
"""

from __future__ import annotations

import uuid

HINT_BITS = 6
# Cells a hint can name (store/cells.py: MAX_CELLS is no larger).
HINTED_CELLS = 1 << HINT_BITS
_SHIFT = 64
_MASK = (HINTED_CELLS - 1) << _SHIFT


def with_cell_hint(value: int, index: int | None) -> int:
    """A 128-bit id's value with cell `index` (0-based) in its hint bits;
    unchanged when `index` is None (a service outside cells)."""
    if index is None:
        return value
    if not 0 <= index < HINTED_CELLS:
        raise ValueError(f"a cell index is 0 to {HINTED_CELLS - 1}, not {index}")
    return (value & ~_MASK) | index << _SHIFT


def new_reservation_id(index: int | None) -> uuid.UUID:
    """A random (version 4) reservation id hinting at cell `index` (outside
    cells a plain uuid4: the admission path makes one per request)."""
    made = uuid.uuid4()
    return made if index is None else uuid.UUID(int=with_cell_hint(made.int, index))


def hinted_cell(reservation_id: uuid.UUID, cells: int) -> int:
    """The 0-based cell the id's hint names, or 0 for a hint past the last
    cell (an id made outside cells): where the front asks first."""
    index = (reservation_id.int & _MASK) >> _SHIFT
    return index if index < cells else 0
