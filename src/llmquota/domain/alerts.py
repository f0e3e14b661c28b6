"""Alerts and their webhooks: records, input checks, signatures, retry timing.

Pure. What fires an alert is SQL (lq_fire_alert, in the transaction of the
change that crossed a threshold); what is here is everything around its
delivery that can be decided without I/O: whether a webhook URL may be
called at all (SSRF), the signature a receiver verifies, the JSON body, and
when to try again.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any
from urllib.parse import urlsplit

from llmquota.domain.destinations import (
    DestinationRules,
    connect_problem,
    is_loopback_name,
    is_own_address,
    literal_address,
)
from llmquota.domain.errors import InvalidRequest

MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 1024
MAX_URL_CHARS = 2048
# DNS's own limits on a host name (RFC 1035, 2.3.4).
MAX_DNS_LABEL_CHARS = 63
MAX_DNS_NAME_CHARS = 253
# Retries: the first after about FIRST_RETRY_SECONDS, doubling up to
# MAX_RETRY_SECONDS, each scaled by a jitter in [0.5, 1.0) so that receivers
# coming back are not hit by every loop at once; given up once the delivery
# is older than MAX_DELIVERY_AGE_SECONDS (a day).
FIRST_RETRY_SECONDS = 5.0
MAX_RETRY_SECONDS = 3_600.0
MAX_DELIVERY_AGE_SECONDS = 86_400.0
# A provider ceiling's alert (domain.ceiling_alerts.CEILING_ALERT_TYPE).
CEILING_EVENT_TYPE = "ceiling.utilization"


@dataclass(frozen=True, slots=True)
class Webhook:
    """A receiver of alerts: every tenant's (tenant None) or one tenant's."""

    name: str
    url: str
    tenant: str | None
    created_at: datetime | None = None
    updated_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class AlertEvent:
    """One alert of the outbox: a threshold crossed once in a window."""

    event_id: uuid.UUID
    event_type: str
    tenant: str | None
    subject: str
    threshold: Decimal
    window_start: datetime
    window_end: datetime | None
    usage: Decimal
    limit: Decimal
    projected_exhaustion_at: datetime | None
    payload: Mapping[str, Any]
    created_at: datetime | None = None
    deliveries: int = 0
    delivered: int = 0
    gave_up: int = 0

    def body(self) -> dict[str, Any]:
        """The JSON a webhook receives; numbers as decimal strings, times in ISO 8601.

        A provider ceiling's alert (ceiling.utilization) has the same envelope,
        its `unit` the bucket that crossed, its window the episode (open: no
        end), and says so in its own words too: `ceiling`, `dimension`,
        `utilization` (the share of the bucket in use when it crossed) and
        `episode_start`.
        """
        body: dict[str, Any] = {
            "id": str(self.event_id),
            "type": self.event_type,
            "tenant": self.tenant,
            "quota": self.payload.get("quota"),
            "route": self.payload.get("route"),
            # a key's quota: the key (absent for the tenant's and routes' quotas)
            **({"key_id": self.payload["key_id"]} if "key_id" in self.payload else {}),
            "unit": self.payload.get("unit", self.payload.get("dimension")),
            "threshold": _number(self.threshold),
            "usage": _number(self.usage),
            "limit": _number(self.limit),
            "window_start": self.window_start.isoformat(),
            "window_end": self.window_end.isoformat() if self.window_end else None,
            "projected_exhaustion_at": (
                self.projected_exhaustion_at.isoformat() if self.projected_exhaustion_at else None
            ),
        }
        if self.event_type == CEILING_EVENT_TYPE:
            utilization = self.payload.get("utilization")
            body.update(
                ceiling=self.payload.get("ceiling"),
                dimension=self.payload.get("dimension"),
                utilization=None if utilization is None else _number(Decimal(str(utilization))),
                episode_start=self.window_start.isoformat(),
            )
        return body


@dataclass(frozen=True, slots=True)
class Delivery:
    """A claimed delivery: one event to one webhook, attempt number `attempt`."""

    event: AlertEvent
    webhook: str
    url: str
    secret: str
    attempt: int
    age_seconds: float


@dataclass(frozen=True, slots=True)
class SendResult:
    """What one POST gave: delivered (a 2xx), else the status or error for the record."""

    delivered: bool
    status: int | None = None
    error: str | None = None


def _number(value: Decimal) -> str:
    """A decimal as a plain string without trailing zeros ("0.8", "1200")."""
    return format(value.normalize(), "f")


def encode_body(event: AlertEvent) -> bytes:
    """The exact bytes POSTed (and signed): compact JSON, keys in a fixed order."""
    return json.dumps(event.body(), separators=(",", ":"), ensure_ascii=False).encode()


def signature(secret: str, timestamp: int, body: bytes) -> str:
    """The `llmquota-signature` header: t=<unix seconds>,v1=<hex HMAC-SHA256 of "t.body">.

    The timestamp is inside the MAC so a receiver can refuse an old replay.
    """
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256)
    return f"t={timestamp},v1={mac.hexdigest()}"


def verify_signature(secret: str, header: str, body: bytes) -> bool:
    """What a receiver does: recompute the MAC and compare in constant time."""
    try:
        fields = dict(part.split("=", 1) for part in header.split(","))
        timestamp = int(fields["t"])
    except (KeyError, ValueError):
        return False
    expected = signature(secret, timestamp, body)
    return hmac.compare_digest(expected, header)


def retry_delay_seconds(attempt: int, age_seconds: float, jitter: float) -> float | None:
    """Seconds until the next attempt after failed attempt `attempt` (1-based), or
    None to give up: the delivery would be older than MAX_DELIVERY_AGE_SECONDS.

    `jitter` in [0, 1) comes from the caller's random source.
    """
    exponent = min(max(attempt - 1, 0), 30)
    base = min(FIRST_RETRY_SECONDS * 2.0**exponent, MAX_RETRY_SECONDS)
    delay = base * (0.5 + 0.5 * min(max(jitter, 0.0), 1.0))
    if age_seconds + delay > MAX_DELIVERY_AGE_SECONDS:
        remaining = MAX_DELIVERY_AGE_SECONDS - age_seconds
        # One last try at the day's end, when there is time left for one.
        return remaining if remaining >= 1.0 else None
    return delay


def check_secret(value: object) -> str:
    """A webhook secret: MIN_SECRET_BYTES to MAX_SECRET_BYTES bytes of UTF-8."""
    if not isinstance(value, str):
        raise InvalidRequest("secret must be a string")
    size = len(value.encode("utf-8", errors="replace"))
    if not MIN_SECRET_BYTES <= size <= MAX_SECRET_BYTES or "\x00" in value:
        raise InvalidRequest(
            f"secret must be {MIN_SECRET_BYTES} to {MAX_SECRET_BYTES} bytes (no NUL)"
        )
    return value


def check_webhook_url(value: object, rules: DestinationRules | None = None) -> str:
    """An http(s) URL whose host, when it is an address or a name for this
    machine, passes the destination rules (llmquota.domain.destinations).

    A host name is resolved and its addresses checked by the adapter, at
    registration and again at every delivery (the connection then goes to the
    address that was checked).
    """
    rules = rules or DestinationRules()
    if not isinstance(value, str) or not 0 < len(value) <= MAX_URL_CHARS:
        raise InvalidRequest(f"url must be an http(s) URL of at most {MAX_URL_CHARS} characters")
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError as exc:
        raise InvalidRequest("url is not a valid URL") from exc
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidRequest("url must be an http:// or https:// URL with a host")
    if any(ch.isspace() for ch in value) or not value.isascii():
        raise InvalidRequest("url must be ASCII without spaces")
    host = parts.hostname
    effective_port = port if port is not None else (443 if parts.scheme == "https" else 80)
    address = literal_address(host)
    if address is not None or is_loopback_name(host):
        problem = connect_problem(host, effective_port, [address] if address else [], rules)
        if problem is not None:
            raise InvalidRequest(f"url: {problem}, refused")
    elif is_own_address(host, effective_port, rules.own):
        raise InvalidRequest("url: that is this service's own listening address, refused")
    elif not _is_dns_name(host):
        # No resolver takes it (IDNA refuses a label over 63 characters with a
        # UnicodeError, which was a 500): it could never be delivered to.
        raise InvalidRequest(
            f"url: host names have labels of 1 to {MAX_DNS_LABEL_CHARS} characters, "
            f"at most {MAX_DNS_NAME_CHARS} in all"
        )
    return value


def _is_dns_name(host: str) -> bool:
    """Whether `host` has the shape of a DNS name (RFC 1035 lengths; a final dot allowed)."""
    name = host.removesuffix(".")
    return 0 < len(name) <= MAX_DNS_NAME_CHARS and all(
        0 < len(label) <= MAX_DNS_LABEL_CHARS for label in name.split(".")
    )
