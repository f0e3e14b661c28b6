"""Keeping a secret out of bytes relayed from elsewhere.

Pure. The proxy relays what a provider answers, and a provider may echo the
key it was called with: in an error message, in a mid-stream error event,
in a debugging field of a 200. The echo is not always the key's plain bytes:
a JSON encoder may escape any character as `\\u00XX`, a message may quote it
upper-cased, a URL in an answer may percent-encode it. So the match is per
character, each in any of those spellings and either case, mixed freely
within one occurrence; every occurrence is replaced by a fixed marker.
"""

from __future__ import annotations

import re

SCRUBBED = b"[provider key]"


def _character(char: str) -> bytes:
    """One character of the secret in every spelling, as a regex alternation."""
    code = ord(char)
    spellings = [re.escape(char.encode())]
    if code < 0x10000:
        spellings.append(rb"\\u" + f"{code:04x}".encode())
    if code < 0x80:
        spellings.append(b"%" + f"{code:02x}".encode())
    if char == "/":
        spellings.append(rb"\\/")  # JSON's optional escape of the solidus
    return b"(?:" + b"|".join(spellings) + b")"


class SecretScrubber:
    """Replaces every spelling of one secret in bytes with SCRUBBED."""

    __slots__ = ("_first", "_pattern")

    def __init__(self, secret: str) -> None:
        if not secret:
            raise ValueError("a secret to scrub must not be empty")
        body = b"".join(_character(char) for char in secret)
        self._pattern = re.compile(body, re.IGNORECASE)
        # The spellings its first character can start with: a cheap test
        # before the regex (most relayed chunks contain none of them).
        first = secret[0]
        self._first = tuple({first.lower().encode(), first.upper().encode(), b"\\u", b"\\U", b"%"})

    def scrub(self, data: bytes) -> bytes:
        """`data` with every occurrence of the secret replaced."""
        if not any(marker in data for marker in self._first):
            return data
        return self._pattern.sub(SCRUBBED, data)
