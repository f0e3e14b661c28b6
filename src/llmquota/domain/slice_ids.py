"""Reservation ids that a worker makes when it admits from a slice.

An admission from a slice (admission/allotments.py) gets its id in the
worker, and its reservation row is written up to one journal interval later,
by whichever worker holds the slice. A settle that finds no row for such an
id must look again once that interval has passed; any other id that is not
found is simply unknown, and waiting for it would only delay the 404. The
id's form tells the two apart: a slice's ids are version-7 UUIDs (RFC 9562:
48 bits of Unix milliseconds, then 74 random bits), where PostgreSQL makes
version 4 and a worker in an outage version 8 (outage_ids.py). Time-ordered
ids also land at the right-hand end of the reservations primary key, in the
order the journal writes them.

The random bits come from the OS in blocks (one `os.urandom` per 256 ids),
so an id costs no system call on the admission path. A process forked from
one that holds a block draws a block of its own before its first id (else
parent and child would make the same ids within a millisecond). One event
loop's use: SliceIds is not for several threads at once.
"""

from __future__ import annotations

import os
import time
import uuid

from llmquota.domain.cell_hints import with_cell_hint

SLICE_ID_VERSION = 7
_RANDOM_BYTES = 10  # 80 drawn, 74 used: 12 beside the version, 62 beside the variant
_BLOCK = 256 * _RANDOM_BYTES
_LOW_62 = (1 << 62) - 1


class SliceIds:
    """Makes version-7 reservation ids, drawing randomness a block at a time."""

    __slots__ = ("_at", "_cell", "_pid", "_random")

    def __init__(self, cell: int | None = None) -> None:
        self._random = b""
        self._at = 0
        self._pid = os.getpid()
        self._cell = cell  # the cell the ids hint at (cell_hints.py), if any

    def new(self) -> uuid.UUID:
        """A fresh id: the time now in milliseconds, then 74 random bits (six
        of them the cell's hint in a cell's service)."""
        at = self._at
        if at + _RANDOM_BYTES > len(self._random) or self._pid != os.getpid():
            self._random, at, self._pid = os.urandom(_BLOCK), 0, os.getpid()
        self._at = at + _RANDOM_BYTES
        bits = int.from_bytes(self._random[at : at + _RANDOM_BYTES])
        millis = time.time_ns() // 1_000_000
        value = (
            (millis & 0xFFFF_FFFF_FFFF) << 80
            | SLICE_ID_VERSION << 76
            | ((bits >> 62) & 0xFFF) << 64
            | 0b10 << 62  # the RFC 4122 / 9562 variant
            | bits & _LOW_62
        )
        return uuid.UUID(int=value if self._cell is None else with_cell_hint(value, self._cell))


def may_be_journaled_later(reservation_id: uuid.UUID) -> bool:
    """Whether the id has the form of one admitted from a slice (not yet journaled,
    perhaps), so that a lookup that missed it is worth one more after the interval."""
    return reservation_id.version == SLICE_ID_VERSION
