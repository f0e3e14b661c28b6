"""What the client sends and reads: the JSON of the admission endpoints, as types.

Pure (no I/O), shared by the sync and the async client so that both say and
understand exactly the same. The field names are the API's (README's
walk-through, api/schemas.py); nothing is validated here that the server
validates anyway, so a bad value gets the server's own 422, as InvalidRequest.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Required, TypedDict

from llmquota.domain.errors import InvalidRequest
from llmquota.domain.settlement import Settlement
from llmquota.domain.vocabulary import Priority

ADMIT_PATH = "/v1/admit"
# A generated idempotency key: the prefix says who made it (at most 255 characters in all).
GENERATED_KEY_PREFIX = "llmquota-client-"


class AdmitFields(TypedDict, total=False):
    """The fields of POST /v1/admit (less max_wait_ms, which the client waits out itself)."""

    tenant: Required[str]
    model: Required[str]
    max_tokens: Required[int]
    # Exactly one of messages (counted by the server) or input_tokens.
    messages: Sequence[Mapping[str, Any]] | None
    input_tokens: int | None
    route: str | None
    lease_seconds: int | None
    idempotency_key: str | None
    priority: Priority | None
    fallback_models: Sequence[str] | None
    degrade: bool | None
    # The deployments that may serve the model, and how one is chosen.
    upstreams: Sequence[str] | None
    upstream_rule: str | None


def admit_body(fields: AdmitFields, *, generate_key: bool) -> dict[str, Any]:
    """The JSON body of an admission; fields left None are left out.

    `generate_key`: give the request an idempotency key when the caller gave
    none, so that an attempt repeated after a lost answer is replayed by the
    server (the same reservation) instead of admitted twice.
    """
    body: dict[str, Any] = {name: value for name, value in fields.items() if value is not None}
    if "messages" in body:
        body["messages"] = [dict(message) for message in body["messages"]]
    for listed in ("fallback_models", "upstreams"):
        if listed in body:
            body[listed] = list(body[listed])
    if generate_key and "idempotency_key" not in body:
        body["idempotency_key"] = GENERATED_KEY_PREFIX + uuid.uuid4().hex
    return body


def reservation_path(reservation_id: uuid.UUID, action: str) -> str:
    """The path of a reservation's settle, release or heartbeat."""
    return f"/v1/reservations/{reservation_id}/{action}"


def check_max_wait_ms(max_wait_ms: int) -> int:
    """How long a caller may wait for room: a whole number of milliseconds, 0 or more."""
    if isinstance(max_wait_ms, bool) or not isinstance(max_wait_ms, int) or max_wait_ms < 0:
        raise InvalidRequest("max_wait_ms must be an integer of at least 0")
    return max_wait_ms


@dataclass(frozen=True, slots=True)
class Answer:
    """One HTTP answer, read: its status, headers (lower-cased names) and body."""

    status: int
    headers: Mapping[str, str]
    text: str

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    @property
    def body(self) -> dict[str, Any]:
        """The JSON object of the body ({} when it is none)."""
        try:
            parsed = json.loads(self.text) if self.text else {}
        except ValueError:
            return {}
        return parsed if isinstance(parsed, dict) else {}

    @property
    def error(self) -> dict[str, Any] | None:
        """The `error` object of llmquota's error shape; None when the body is not that."""
        error = self.body.get("error")
        return error if isinstance(error, dict) and "type" in error else None

    def retry_after_ms(self) -> int | None:
        """The server's retry hint in milliseconds, the most precise one it gave.

        `retry-after-ms` (the refusals and the 503s of fair share send it),
        else the body's `retry_after_ms`, else `Retry-After` in seconds (its
        HTTP-date form is not used by llmquota and is ignored).
        """
        for text in (self.headers.get("retry-after-ms"), _body_hint(self.error)):
            if text is not None and text.isdigit():
                return int(text)
        seconds = self.headers.get("retry-after")
        if seconds is not None and seconds.isdigit():
            return int(seconds) * 1000
        return None


def _body_hint(error: dict[str, Any] | None) -> str | None:
    hint = None if error is None else error.get("retry_after_ms")
    return str(hint) if isinstance(hint, int) and not isinstance(hint, bool) else None


@dataclass(frozen=True, slots=True)
class Admitted:
    """The 201 of POST /v1/admit, typed; `answer` is the whole body as sent."""

    reservation_id: uuid.UUID
    reserved_tokens: int
    input_tokens: int
    input_estimated: bool
    lease_expires_at: datetime
    lease_generation: int
    # The model admitted: a fallback when the requested one was refused.
    model: str
    degraded: bool
    # {"strategy": "max_tokens" | "learned" | "fixed", "tokens": N}
    output_estimate: dict[str, Any]
    # What is left at the tightest layer of each kind (null where unlimited).
    remaining: dict[str, Any]
    priority: Priority | None
    answer: dict[str, Any]
    # The deployment chosen among the request's upstreams (None: none named).
    upstream: str | None = None

    @classmethod
    def of(cls, body: dict[str, Any]) -> Admitted:
        return cls(
            reservation_id=uuid.UUID(body["reservation_id"]),
            reserved_tokens=int(body["reserved_tokens"]),
            input_tokens=int(body["input_tokens"]),
            input_estimated=bool(body["input_estimated"]),
            lease_expires_at=datetime.fromisoformat(body["lease_expires_at"]),
            lease_generation=int(body["lease_generation"]),
            model=str(body["model"]),
            degraded=bool(body["degraded"]),
            output_estimate=dict(body["output_estimate"]),
            remaining=dict(body["remaining"]),
            priority=body.get("priority"),
            answer=body,
            upstream=body.get("upstream"),
        )


def settle_body(input_tokens: int, output_tokens: int, outcome: str) -> dict[str, Any]:
    return {"input_tokens": input_tokens, "output_tokens": output_tokens, "outcome": outcome}


def settlement_of(body: dict[str, Any]) -> Settlement:
    """The 200 of settle as the library's Settlement (what it charged and refunded)."""
    return Settlement(
        charged_tokens=int(body["charged_tokens"]),
        refunded_tokens=int(body["refunded_tokens"]),
        late=bool(body["late"]),
    )


def lease_of(body: dict[str, Any]) -> tuple[datetime, int]:
    """The 200 of heartbeat: the lease's new expiry and its generation."""
    return datetime.fromisoformat(body["lease_expires_at"]), int(body["lease_generation"])


def heartbeat_body(lease_seconds: int | None) -> dict[str, Any] | None:
    return None if lease_seconds is None else {"lease_seconds": lease_seconds}
