"""Free text and timestamps as the OpenAPI document declares them.

Pure. Each rule is written once, as a regular expression that Python's `re`
and JavaScript's (so every JSON Schema validator and generator) read alike,
and the server checks exactly that expression: a client generated from the
schema, or a fuzzer drawing values from it, is never refused for a rule the
schema did not state. The expressions name characters by escape (`\\x1b`),
so the document stays plain ASCII.

One rule no pattern states: a lone surrogate (JSON's "\\ud800" alone) is
no Unicode character at all, so it is not text that any schema describes
(the Rust and JavaScript engines cannot even write it in a pattern); the
server refuses it too, as PostgreSQL could not store it.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Field

# What a terminal or log line shows as text: no C0 or C1 control character
# (newlines and ESC among them), no DEL, no line or paragraph separator, no
# bidirectional override (which reorders what a reader sees).
_SHOWN = r"[^\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]"
# What PostgreSQL stores: anything but NUL.
_STORABLE = r"[^\x00]"
# An RFC 3339 date-time, the offset required (a date-time without one names
# no moment); what JSON Schema's `format: date-time` means.
DATE_TIME_PATTERN = (
    r"^[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt][0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]+)?"
    r"([Zz]|[+-][0-9]{2}:[0-9]{2})$"
)
_DATE_TIME = re.compile(DATE_TIME_PATTERN)


def shown_text_pattern(max_chars: int) -> str:
    """1 to `max_chars` characters of text safe to show (see _SHOWN)."""
    return f"^{_SHOWN}{{1,{max_chars}}}$"


def storable_text_pattern(max_chars: int) -> str:
    """1 to `max_chars` characters PostgreSQL can store (see _STORABLE)."""
    return f"^{_STORABLE}{{1,{max_chars}}}$"


def matches(pattern: str, value: str) -> bool:
    """Whether `value` is all of `pattern` (Python's `$` would allow a final newline)."""
    return re.fullmatch(pattern.removeprefix("^").removesuffix("$"), value) is not None


def is_unicode(value: str) -> bool:
    """Whether `value` is Unicode text: no lone surrogate, so it encodes as UTF-8."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def pattern_check(pattern: str, rule: str) -> AfterValidator:
    """A validator refusing a string that is not all of `pattern`, with `rule` as the reason."""

    def check(value: str) -> str:
        if not is_unicode(value) or not matches(pattern, value):
            raise ValueError(rule)
        return value

    return AfterValidator(check)


def pattern_field(pattern: str, max_chars: int, rule: str) -> Any:
    """The Field that shows `pattern` (and its length bounds) in the schema."""
    return Field(
        min_length=1, max_length=max_chars, description=rule, json_schema_extra={"pattern": pattern}
    )


def parse_date_time(value: object) -> datetime:
    """An RFC 3339 date-time string as an aware datetime; ValueError for anything else.

    Not a Unix time: `0.5` or `1700000000` in a query is a 422, as the
    schema's `format: date-time` says, instead of a moment in 1970.
    """
    if not isinstance(value, str) or _DATE_TIME.fullmatch(value) is None:
        raise ValueError("must be an RFC 3339 date-time with an offset, e.g. 2030-01-01T00:00:00Z")
    try:
        return datetime.fromisoformat(value.upper())
    except ValueError as exc:
        raise ValueError(f"{value!r} is not a valid date-time") from exc


# A request's date-time (bodies and queries): RFC 3339, as JSON Schema's
# `format: date-time`; the schema keeps pydantic's `type: string, format: date-time`.
DateTime = Annotated[datetime, BeforeValidator(parse_date_time)]
