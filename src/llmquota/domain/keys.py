"""API keys: how one is made, how it is stored, and whose it is.

A key is 32 random bytes, so a plain SHA-256 digest is enough to store it
(no password hashing needed: there is nothing to brute-force). Pure: the
REST adapter, the admin service and the CLI all make and digest keys the
same way because they all do it here.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from llmquota.domain.errors import InvalidRequest
from llmquota.domain.json_text import is_unicode, matches, shown_text_pattern
from llmquota.domain.key_limits import NO_LIMITS, KeyLimits

KEY_PREFIX = "lq_"
# How much of a secret is kept in the clear to tell keys apart: "lq_" and 8
# random characters (48 bits), too few to guess the other 40.
SHOWN_PREFIX_CHARS = 11
# What a tenant key may do: `admit` the reservation lifecycle and the proxy,
# `read` the tenant's GET endpoints (status, usage, its keys).
SCOPES = ("admit", "read")
# The longest a rotated-out secret keeps working.
MAX_GRACE_SECONDS = 7 * 24 * 3600
MAX_LABEL_CHARS = 200
# What the OpenAPI document says a label is (llmquota.domain.json_text).
LABEL_PATTERN = shown_text_pattern(MAX_LABEL_CHARS)
LABEL_RULE = (
    f"1 to {MAX_LABEL_CHARS} characters, without control characters, line separators, "
    "bidirectional overrides or lone surrogates"
)


def new_key() -> str:
    """A fresh random API key."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def key_digest(key: str) -> bytes:
    """The stored form of a key."""
    return hashlib.sha256(key.encode()).digest()


def shown_prefix(key: str) -> str:
    """The part of a secret listed with its key."""
    return key[:SHOWN_PREFIX_CHARS]


def check_scopes(scopes: Iterable[str]) -> tuple[str, ...]:
    """Known scopes, deduplicated in the canonical order; InvalidRequest otherwise."""
    wanted = set(scopes)
    unknown = sorted(wanted - set(SCOPES))
    if unknown:
        raise InvalidRequest(f"'scopes': unknown scope(s) {unknown}; known: {list(SCOPES)}")
    if not wanted:
        raise InvalidRequest("'scopes': a key needs at least one scope")
    return tuple(scope for scope in SCOPES if scope in wanted)


def check_grace_seconds(grace_seconds: int) -> int:
    if not 0 <= grace_seconds <= MAX_GRACE_SECONDS:
        raise InvalidRequest(f"'grace_seconds' must be between 0 and {MAX_GRACE_SECONDS} (7 days)")
    return grace_seconds


def check_label(label: str | None) -> str | None:
    """A label is shown in tables and logs: LABEL_PATTERN, the schema's own."""
    if label is not None and not (is_unicode(label) and matches(LABEL_PATTERN, label)):
        raise InvalidRequest(f"'label': {LABEL_RULE}")
    return label


@dataclass(frozen=True, slots=True)
class KeyOwner:
    """A stored key's id and tenant; no tenant means an admin key.

    `scopes`: what the key may do; `suspended`: its tenant is suspended;
    `valid_seconds`: how long, from the lookup, this secret stays valid
    (its expiry or the end of a rotation's grace; None: no end);
    `models`: the models it may name (None: any).
    """

    key_id: int
    tenant: str | None
    scopes: frozenset[str] = frozenset(SCOPES)
    suspended: bool = False
    valid_seconds: float | None = None
    models: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """A stored key as listed: never its secret nor its digest."""

    key_id: int
    tenant: str | None
    prefix: str | None
    label: str | None
    scopes: tuple[str, ...]
    created_at: datetime
    last_used_at: datetime | None
    expires_at: datetime | None
    revoked_at: datetime | None
    limits: KeyLimits = NO_LIMITS


@dataclass(frozen=True, slots=True)
class IssuedKey:
    """A key just created or rotated: its secret (shown once) and its record."""

    key: str
    record: KeyRecord
