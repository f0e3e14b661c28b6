"""The bodies of the key lifecycle's endpoints (routes/keys.py).

Never a secret's digest: a listed key shows `prefix`, the first characters of
its secret as shown at creation; the secret itself only in the answer that
creates or rotates it.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictStr

from llmquota.domain.json_numbers import WholeNumber
from llmquota.domain.json_text import DateTime, pattern_check, pattern_field
from llmquota.domain.key_limits import KeyLimits
from llmquota.domain.keys import (
    LABEL_PATTERN,
    LABEL_RULE,
    MAX_GRACE_SECONDS,
    MAX_LABEL_CHARS,
    KeyRecord,
)

ScopeName = Literal["admit", "read"]
Label = Annotated[
    StrictStr,
    pattern_field(LABEL_PATTERN, MAX_LABEL_CHARS, LABEL_RULE),
    pattern_check(LABEL_PATTERN, LABEL_RULE),
]


class AdminKeyBody(BaseModel):
    """POST /v1/admin/keys: an admin key may do everything, so it has no scopes.

    `expires_at` is an RFC 3339 date-time with its offset, as in the usage query.
    """

    model_config = ConfigDict(extra="forbid")

    label: Label | None = None
    expires_at: DateTime | None = None


class KeyBody(AdminKeyBody, KeyLimits):
    """POST /v1/tenants/{tenant}/keys (every field optional): the key's own limits
    (KeyLimits: tokens_per_minute, requests_per_minute, max_in_flight, models, ...)
    sit at the top level, beside its label, expiry and scopes."""

    scopes: Annotated[list[ScopeName], Field(min_length=1)] = ["admit", "read"]

    @property
    def limits(self) -> KeyLimits:
        return KeyLimits.model_validate(self.model_dump(include=set(KeyLimits.model_fields)))


class RotateBody(BaseModel):
    """POST .../keys/{id}/rotate: how long the old secret keeps working."""

    model_config = ConfigDict(extra="forbid")

    grace_seconds: Annotated[int, WholeNumber(ge=0, le=MAX_GRACE_SECONDS)] = 0


class KeyInfo(BaseModel):
    """One key as listed."""

    id: int
    tenant: str | None
    prefix: str | None
    label: str | None
    scopes: list[str]
    created_at: datetime
    last_used_at: datetime | None
    expires_at: datetime | None
    revoked_at: datetime | None
    # The key's own limits (null: not set) and the models it may name (null: any).
    tokens_per_minute: int | None = None
    token_burst: int | None = None
    requests_per_minute: int | None = None
    request_burst: int | None = None
    max_in_flight: int | None = None
    models: list[str] | None = None

    @classmethod
    def of(cls, record: KeyRecord) -> KeyInfo:
        return cls(
            **record.limits.model_dump(),
            id=record.key_id,
            tenant=record.tenant,
            prefix=record.prefix,
            label=record.label,
            scopes=list(record.scopes),
            created_at=record.created_at,
            last_used_at=record.last_used_at,
            expires_at=record.expires_at,
            revoked_at=record.revoked_at,
        )


class KeyResponse(KeyInfo):
    """201 from creating a key, 200 from rotating one: `key` is shown once, stored hashed."""

    key: str


class SuspensionResponse(BaseModel):
    """POST /v1/tenants/{tenant}/suspend or /resume."""

    tenant: str
    suspended: bool
    suspended_at: datetime | None
