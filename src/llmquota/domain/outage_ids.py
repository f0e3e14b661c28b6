"""Reservation ids that workers make during an outage: recognisable and signed.

While the store cannot answer, a worker admits on its own (failure modes
open and local) and makes the reservation id itself. Such an id is a
version-8 UUID, so anyone can tell it from PostgreSQL's version-4 ids, and
half of it is a MAC under a key every worker loads from the database
(`outage_id_key`). That tells a real id that is not recorded yet (some
worker holds it in its journal: retry, 503) from one nobody made (404),
without asking every worker's journal.

Layout of the 16 bytes: 60 random bits (bytes 0-7 less the version nibble),
then 62 bits of HMAC-SHA256 over bytes 0-7 (bytes 8-15 less the variant bits).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import uuid

from llmquota.domain.cell_hints import with_cell_hint

OUTAGE_ID_VERSION = 8
# Bytes of key the database holds (migration 0007).
OUTAGE_ID_KEY_BYTES = 32


def new_outage_id(key: bytes, cell: int | None = None) -> uuid.UUID:
    """A random reservation id, marked as made by a worker, hinting at its
    `cell` (cell_hints.py: in the random head, so signed too) and signed
    with `key`."""
    head = bytearray(secrets.token_bytes(8))
    head[6] = (head[6] & 0x0F) | (OUTAGE_ID_VERSION << 4)
    hinted = with_cell_hint(int.from_bytes(bytes(head) + bytes(8)), cell).to_bytes(16)[:8]
    return uuid.UUID(bytes=hinted + _tail(key, hinted))


def is_outage_id(reservation_id: uuid.UUID) -> bool:
    """Whether the id has the form of one a worker made during an outage."""
    return reservation_id.version == OUTAGE_ID_VERSION


def is_signed_outage_id(reservation_id: uuid.UUID, key: bytes) -> bool:
    """Whether a worker holding `key` made this id (not merely one of its form)."""
    raw = reservation_id.bytes
    return is_outage_id(reservation_id) and hmac.compare_digest(raw[8:], _tail(key, raw[:8]))


def _tail(key: bytes, head: bytes) -> bytes:
    """The MAC half of an id, with the RFC 4122 variant bits set."""
    mac = bytearray(hmac.new(key, head, hashlib.sha256).digest()[:8])
    mac[0] = (mac[0] & 0x3F) | 0x80
    return bytes(mac)
