"""JSON Merge Patch (RFC 7396): how a PATCH body changes a stored document.

A member present in the patch replaces the target's, a member set to null
removes it (the stored policy then falls back to its plan's or the default
value), an absent member is kept; an object member merges recursively, any
other value (arrays included) replaces whole. Pure: the API validates the
result like a PUT body before anything is written.
"""

from __future__ import annotations

from typing import Any


def merge_patch(target: Any, patch: Any) -> Any:
    """The document `patch` makes of `target` (neither is changed)."""
    if not isinstance(patch, dict):
        return patch
    result: dict[str, Any] = dict(target) if isinstance(target, dict) else {}
    for name, value in patch.items():
        if value is None:
            result.pop(name, None)
        else:
            result[name] = merge_patch(result.get(name), value)
    return result
