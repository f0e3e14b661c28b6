"""JSON from outside, parsed with a bound on its nesting.

Pure. Python's json parser recurses once per nesting level, so a body of
100,000 `[` raises RecursionError (an internal error, a 500) instead of a
clean refusal; and a structure nested thousands deep, parsed, still makes
every later walk over it (token counting, re-encoding for the upstream)
recursive. No request or provider answer llmquota accepts nests anywhere
near MAX_JSON_DEPTH, so deeper JSON is refused as malformed, wherever it
comes from: a client's body or an upstream's event.
"""

from __future__ import annotations

import json

# Deepest nesting of arrays and objects accepted. Chat requests nest about 6
# deep (messages, content parts, tool schemas a few more).
MAX_JSON_DEPTH = 64


class JsonTooDeep(ValueError):
    """JSON nested deeper than MAX_JSON_DEPTH (a ValueError, as malformed JSON is)."""


def loads_bounded(raw: bytes | str, max_depth: int = MAX_JSON_DEPTH) -> object:
    """json.loads, refusing nesting deeper than `max_depth` with JsonTooDeep.

    Raises ValueError (JSONDecodeError, UnicodeDecodeError or JsonTooDeep)
    for anything that is not JSON within the bound.
    """
    try:
        value = json.loads(raw)
    except RecursionError:
        raise JsonTooDeep(f"JSON nested deeper than {max_depth} levels") from None
    if _depth_exceeds(value, max_depth):
        raise JsonTooDeep(f"JSON nested deeper than {max_depth} levels")
    return value


def _depth_exceeds(value: object, max_depth: int) -> bool:
    """Whether `value` nests deeper than `max_depth`; iterative, so any depth is safe."""
    pending: list[tuple[object, int]] = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, dict):
            children: list[object] = list(item.values())
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > max_depth:
            return True
        pending.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False
