"""How a refused admission answers over HTTP: 429 or 413, body and headers.

A refusal is an answer of the limiter, not an exception of the route, and
clients branch on its fields (`limit`, `scope`, `retry_after_ms`, ...) and its
retry headers. Status, error type, body fields and whether retry hints go
with it are the refusal table's (domain/refusal_table.py), which the library's
exceptions and proxy mode read too; the sentence is domain/refusals.py's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi.responses import JSONResponse

from llmquota.api.errors import error_response
from llmquota.domain.records import AdmitDecision
from llmquota.domain.refusal_table import REFUSALS
from llmquota.domain.refusals import ceil_seconds, refusal_message
from llmquota.domain.vocabulary import Priority, lowered_from


def refusal_response(
    tenant: str,
    decision: AdmitDecision,
    headers: Mapping[str, str],
    requested_priority: Priority | None = None,
) -> JSONResponse | None:
    """The answer to a refused decision (429, 413, 402, 422); None for any other.

    `headers` (the rate-limit headers) are sent with it, a retryable
    refusal's retry hints after them. A priority asked for above the plan's
    is named (`priority_lowered_from`) beside the one the decision used.
    """
    d = decision
    rule = REFUSALS.get(d.status)
    if rule is None:
        return None
    fields = rule.fields(d)
    lowered = lowered_from(requested_priority, d.priority)
    if lowered is not None:
        fields["priority_lowered_from"] = lowered
    sent = dict(headers)
    if rule.retry:
        retry_ms = int(d.retry_after_ms or 1)
        sent |= {"Retry-After": str(ceil_seconds(retry_ms)), "retry-after-ms": str(retry_ms)}
        fields["retry_after_ms"] = retry_ms
    return error_response(
        rule.http_status,
        rule.error_type,
        headers=sent,
        message=refusal_message(tenant, d),
        **fields,
    )


def refusal_cause(d: AdmitDecision) -> dict[str, Any]:
    """What refused the requested model: limit, scope, reason, and the ceiling if one."""
    cause: dict[str, Any] = {"limit": d.limit_kind, "scope": d.limit_scope, "reason": d.reason}
    if d.ceiling is not None:
        cause["ceiling"] = d.ceiling
    return cause
