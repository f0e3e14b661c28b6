"""The schemathesis CLI's hooks for tests/faults/test_schemathesis_cli.py.

The OpenAPI document states every rule of the server that JSON Schema can
state (llmquota.api.openapi, the models' patterns, bounds and rules between
fields). A few refusals depend on what no schema can see: the clock, what
is stored, what a host name resolves to. A generated request the schema
calls valid may meet one of them and get its 422; such a refusal is the
server being right, not the schema being wrong. This hook drops exactly
those: a "schema-valid request rejected" failure whose 422 (or 413) names one of
the reasons below, each with why no schema can say it. Every other failure,
every other check, and every other 422 still fails the run.
"""

from __future__ import annotations

from typing import Any

import schemathesis
from schemathesis.openapi.checks import RejectedPositiveData

from llmquota.api.routes.policy_patch import MERGED_RESULT

# A reason the server gives (part of its message) -> why no schema can state it.
UNSTATEABLE: dict[str, str] = {
    "'expires_at' must be in the future": "JSON Schema has no clock",
    "'from' must be before 'to'": "the window is compared with now when 'to' is left out",
    "not a cursor this API returned": "a cursor is signed by the server",
    "idempotency_key was already used": "an earlier request stored the key",
    "unknown plan": "the plan a policy names must be stored",
    "cannot be split over": "each global limit must be at least `shards` (two fields compared)",
    "the requested model": "fallback_models may not repeat `model` (two fields compared)",
    "url: ": "a webhook's host is resolved and checked against the destination rules",
    "url must be an http": "urlsplit's idea of a host, port and scheme is no pattern",
    "url is not a valid URL": "urlsplit's idea of a host, port and scheme is no pattern",
    "secret must be": "the server counts a secret's UTF-8 bytes, the schema its characters",
    "increasing order of 'above'": "a ceiling's steps are compared with each other",
    "alert_at: thresholds must be in increasing order": "a ceiling's thresholds are compared",
    "a sharded global layer has no max_in_flight": "the layer may be sharded by its stored count",
    "was used for a top-up of": "an earlier top-up stored the reference",
    "it can never fit": "the tenant's stored capacity is smaller than the request",
}
# A PATCH body is a merge patch (RFC 7396): whether its result is a valid
# resource depends on the stored one it merges into (a token_burst patched
# onto a plan without tokens_per_minute), which the server answers with 422
# (RFC 5789), its message beginning with MERGED_RESULT. No schema of the patch
# alone can say which patches those are; any other 422 of a PATCH still fails.
MERGED_INTO_STORED = "PATCH"
# The statuses of those refusals: 422, and 413 for an admission larger than the
# stored capacity of a layer ("it can never fit").
UNSTATEABLE_STATUSES = (413, 422)


def unstateable_reason(message: str) -> str | None:
    """Why no schema can state the refusal `message` gives; None for any other."""
    return next((why for reason, why in UNSTATEABLE.items() if reason in message), None)


@schemathesis.hook
def filter_failure(context: Any, failure: Any, case: Any, response: Any) -> bool:
    """Keep every failure but a positive case's 422 for one of UNSTATEABLE's reasons
    (or, for a PATCH, for its merged result)."""
    if not isinstance(failure, RejectedPositiveData):
        return True
    if response.status_code not in UNSTATEABLE_STATUSES:
        return True
    try:
        message = str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return True
    if case.method.upper() == MERGED_INTO_STORED and message.startswith(MERGED_RESULT):
        return False
    return unstateable_reason(message) is None
