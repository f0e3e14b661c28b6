"""API keys: how one is made, how it is stored, and whose it is.

A key is 32 random bytes, so a plain SHA-256 digest is enough to store it
(no password hashing needed: there is nothing to brute-force). Pure: the
REST adapter, the admin service and the CLI all make and digest keys the
same way because they all do it here.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

KEY_PREFIX = "lq_"


def new_key() -> str:
    """A fresh random API key."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def key_digest(key: str) -> bytes:
    """The stored form of a key."""
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True, slots=True)
class KeyOwner:
    """A stored key's id and tenant; no tenant means an admin key."""

    key_id: int
    tenant: str | None
