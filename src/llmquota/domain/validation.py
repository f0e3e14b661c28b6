"""Input checks every entry point shares: names, token counts, leases, models.

Pure. The REST schemas, the library, the ledger and the reports validate with
these (or with the ceilings named here), so a value refused on one path is
refused on every path, with the same words.
"""

from __future__ import annotations

import re

from llmquota.domain.errors import InvalidRequest
from llmquota.domain.policy import MAX_LEASE_SECONDS, NAME_PATTERN

# A single token count above this is refused as absurd (and as a likely bug).
MAX_TOKEN_COUNT = 10_000_000
# A tokenizer estimate is off by a factor, not by orders of magnitude.
MAX_ESTIMATE_FACTOR = 10.0
MAX_MODEL_NAME_CHARS = 200
MAX_IDEMPOTENCY_KEY_CHARS = 255

_NAME = re.compile(NAME_PATTERN)


def check_name(kind: str, value: object) -> str:
    """A tenant or route name, or InvalidRequest."""
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise InvalidRequest(f"{kind} must match {NAME_PATTERN}")
    return value


def check_model(value: object) -> str:
    """A model name: a string of 1 to MAX_MODEL_NAME_CHARS characters."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_MODEL_NAME_CHARS:
        raise InvalidRequest(f"model must be a string of 1 to {MAX_MODEL_NAME_CHARS} characters")
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


def check_idempotency_key(value: object) -> None:
    """An idempotency key, when given: a string of 1 to MAX_IDEMPOTENCY_KEY_CHARS characters."""
    if value is not None and (
        not isinstance(value, str) or not 0 < len(value) <= MAX_IDEMPOTENCY_KEY_CHARS
    ):
        raise InvalidRequest(
            f"idempotency_key must be a string of 1 to {MAX_IDEMPOTENCY_KEY_CHARS} characters"
        )
