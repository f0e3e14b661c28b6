"""Pure guards on what crosses the proxy: JSON depth, and the provider key."""

from __future__ import annotations

import json
from urllib.parse import quote

import pytest

from llmquota.domain.json_limits import JsonTooDeep, loads_bounded
from llmquota.domain.scrubbing import SCRUBBED, SecretScrubber


def test_json_nesting_is_bounded_whatever_the_depth() -> None:
    assert loads_bounded(b"[" * 64 + b"]" * 64) is not None
    for depth in (65, 900, 100_000):  # below and beyond the parser's recursion limit
        with pytest.raises(JsonTooDeep, match="deeper than 64"):
            loads_bounded(b"[" * depth + b"]" * depth)
    with pytest.raises(ValueError):
        loads_bounded(b"{not json")
    assert loads_bounded('{"a": [1, {"b": null}]}') == {"a": [1, {"b": None}]}


KEY = "sk-proj-AbC_123/xyz"


@pytest.mark.parametrize(
    "spelling",
    [
        KEY,
        KEY.upper(),
        KEY.lower(),
        "".join(f"\\u{ord(c):04x}" for c in KEY),
        "".join(f"\\u{ord(c):04X}" for c in KEY),
        json.dumps(KEY)[1:-1],
        KEY.replace("/", "\\/"),
        quote(KEY, safe=""),
        "".join(f"%{ord(c):02x}" for c in KEY),
        # Mixed within one occurrence.
        "s\\u006b-PROJ-%41bC_123/xyz",
    ],
)
def test_every_spelling_of_the_key_is_scrubbed(spelling: str) -> None:
    scrubbed = SecretScrubber(KEY).scrub(f'{{"message": "key {spelling} refused"}}'.encode())
    assert scrubbed == b'{"message": "key ' + SCRUBBED + b' refused"}'


def test_text_without_the_key_is_returned_as_it_was() -> None:
    scrubber = SecretScrubber(KEY)
    for text in (b"", b"data: {}\n\n", b"sk-proj-AbC_123/xy", "héllo ✓".encode()):
        assert scrubber.scrub(text) is text or scrubber.scrub(text) == text
    with pytest.raises(ValueError):
        SecretScrubber("")
