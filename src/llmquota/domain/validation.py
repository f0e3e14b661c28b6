"""Input checks every entry point shares: names, token counts, leases, models.

Pure. The REST schemas, the library, the ledger and the reports validate with
these (or with the ceilings named here), so a value refused on one path is
refused on every path, with the same words.
"""

from __future__ import annotations

from llmquota.domain.errors import InvalidRequest
from llmquota.domain.names import (
    MODEL_GLOB_RULE,
    MODEL_RULE,
    NAME_RULE,
    is_model,
    is_model_glob,
    is_name,
)
from llmquota.domain.policy import MAX_LEASE_SECONDS

# A single token count above this is refused as absurd (and as a likely bug).
MAX_TOKEN_COUNT = 10_000_000
# A tokenizer estimate is off by a factor, not by orders of magnitude.
MAX_ESTIMATE_FACTOR = 10.0
MAX_IDEMPOTENCY_KEY_CHARS = 255


def check_name(kind: str, value: object) -> str:
    """A tenant, route, plan, ceiling, quota or webhook name (domain.names), or
    InvalidRequest naming `kind`."""
    if not is_name(value):
        raise InvalidRequest(f"{kind} must be {NAME_RULE}")
    return value


def storable_text_problem(value: str) -> str | None:
    """Why PostgreSQL could not store `value` as text, or None if it can.

    A NUL character is not valid in a PostgreSQL text value, and a lone
    surrogate is not UTF-8 at all: either would make the database refuse the
    whole statement, and with it every request batched with this one.
    """
    if "\x00" in value:
        return "must not contain NUL (\\u0000) characters"
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return "must not contain unpaired surrogates (invalid Unicode)"
    return None


def check_text(field: str, value: object, max_chars: int) -> str:
    """A free-form string that reaches the database: 1 to `max_chars` characters
    that PostgreSQL can store."""
    if not isinstance(value, str) or not 0 < len(value) <= max_chars:
        raise InvalidRequest(f"{field} must be a string of 1 to {max_chars} characters")
    problem = storable_text_problem(value)
    if problem is not None:
        raise InvalidRequest(f"{field} {problem}")
    return value


def check_model(value: object, field: str = "model") -> str:
    """A model name (domain.names), or InvalidRequest naming `field`."""
    if not is_model(value):
        raise InvalidRequest(f"{field} must be {MODEL_RULE}")
    return value


def check_model_glob(value: object, field: str = "models") -> str:
    """A model name or a `*` glob of them (a ceiling's or a quota's), or
    InvalidRequest naming `field`."""
    if not is_model_glob(value):
        raise InvalidRequest(f"{field} must be {MODEL_GLOB_RULE}")
    return value


def check_token_count(name: str, value: object) -> int:
    """A token count: an integer in [0, MAX_TOKEN_COUNT], never a float or bool."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{name} must be an integer")
    if value < 0 or value > MAX_TOKEN_COUNT:
        raise InvalidRequest(f"{name} must be between 0 and {MAX_TOKEN_COUNT}")
    return value


def check_lease_seconds(value: object) -> None:
    """A lease length, when given: an integer number of seconds within the ceiling."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_LEASE_SECONDS:
        raise InvalidRequest(f"lease_seconds must be an integer from 1 to {MAX_LEASE_SECONDS}")


def check_lease_generation(value: object) -> None:
    """A fencing token, when given: a positive integer."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise InvalidRequest("lease_generation must be a positive integer")


def check_idempotency_key(value: object) -> None:
    """An idempotency key, when given: 1 to MAX_IDEMPOTENCY_KEY_CHARS storable characters."""
    if value is not None:
        check_text("idempotency_key", value, MAX_IDEMPOTENCY_KEY_CHARS)
