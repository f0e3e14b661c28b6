"""The admission statement's arguments and rows, as the domain's records.

lq_admit takes one array per field (a batch in one round trip) and answers
one row per request; this module is the translation both ways, kept apart
from the Store so that its shape is read in one place.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from llmquota.domain.records import AdmitDecision, AdmitRequest, TenantFigures
from llmquota.domain.vocabulary import priority_of, priority_rank
from llmquota.store.connection import Row


def admit_arguments(requests: Sequence[AdmitRequest], concurrency_retry_ms: int) -> tuple[Any, ...]:
    """The seventeen arrays (and the retry hint) of lq_admit for a batch, in order."""
    alt_ord: list[int] = []
    alt_models: list[str] = []
    alt_inputs: list[int] = []
    for position, request in enumerate(requests, start=1):
        for model, input_tokens in request.fallbacks:
            alt_ord.append(position)
            alt_models.append(model)
            alt_inputs.append(input_tokens)
    return (
        [r.tenant for r in requests],
        [r.route for r in requests],
        [r.model for r in requests],
        [r.input_tokens for r in requests],
        [r.max_tokens for r in requests],
        [r.input_estimated for r in requests],
        [r.lease_seconds for r in requests],
        [r.idempotency_key for r in requests],
        [r.request_hash for r in requests],
        concurrency_retry_ms,
        [None if r.priority is None else priority_rank(r.priority) for r in requests],
        [r.priority_any for r in requests],
        [r.degrade for r in requests],
        alt_ord,
        alt_models,
        alt_inputs,
        [r.output_reserve for r in requests],
    )


def admit_decision(row: Row) -> AdmitDecision:
    """One row of lq_admit as a decision."""
    rank = row["priority"]
    return AdmitDecision(
        status=row["status"],
        reservation_id=row["reservation_id"],
        reserved_tokens=row["reserved_tokens"],
        lease_expires_at=row["lease_expires_at"],
        lease_generation=row["lease_generation"],
        limit_kind=row["limit_kind"],
        limit_scope=row["limit_scope"],
        retry_after_ms=row["retry_after_ms"],
        capacity=row["capacity"],
        remaining_tokens=row["remaining_tokens"],
        remaining_requests=row["remaining_requests"],
        remaining_in_flight=row["remaining_in_flight"],
        tenant=TenantFigures(
            tokens_per_minute=row["tenant_tokens_per_minute"],
            token_burst=row["tenant_token_burst"],
            tokens=row["tenant_tokens"],
            requests_per_minute=row["tenant_requests_per_minute"],
            request_burst=row["tenant_request_burst"],
            requests=row["tenant_requests"],
        ),
        model=row["model"],
        input_tokens=row["input_tokens"],
        degraded=bool(row["degraded"]),
        reason=row["reason"],
        ceiling=row["ceiling"],
        utilization=row["utilization"],
        priority=None if rank is None else priority_of(rank),
        plan=row["plan"],
        alt_max_tokens=row["alt_max_tokens"],
        alt_models=tuple(row["alt_models"] or ()),
        quota=row["quota"],
        resets_at=_local(row["resets_at"], row["quota_timezone"]),
        credit_balance=row["credit_balance"],
    )


def _local(instant: datetime | None, zone: str | None) -> datetime | None:
    """A quota's reset instant in the quota's own time zone (its local midnight)."""
    if instant is None or zone is None:
        return instant
    try:
        return instant.astimezone(ZoneInfo(zone))
    except ZoneInfoNotFoundError:  # a zone the server knows and Python does not: UTC
        return instant
