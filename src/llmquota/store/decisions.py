"""The admission statement's arguments and rows, as the domain's records.

lq_admit takes one array per field (a batch in one round trip) and answers
one row per request; this module is the translation both ways, kept apart
from the Store so that its shape is read in one place. lq_finish's arrays
are built here too, for the same reason.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from llmquota.domain.records import (
    AdmitDecision,
    AdmitRequest,
    FinishRequest,
    FinishResult,
    TenantFigures,
    TokenLayerFigures,
)
from llmquota.domain.vocabulary import priority_of, priority_rank
from llmquota.store.connection import Row


def admit_arguments(requests: Sequence[AdmitRequest], concurrency_retry_ms: int) -> tuple[Any, ...]:
    """The arrays (and the retry hint) of lq_admit for a batch, in order, less its deadline
    and reservation ids; then each request's API key (p_key_ids), each explicit
    fallback's output reserve (p_alt_outputs) and the serving path it journals
    (p_serving_paths); then the deployments of each candidate model, flattened
    (p_up_*: request position, model, deployment, rule), last."""
    # Explicit fallbacks: request position, model, input, output reserve.
    alts = _flattened(requests, lambda request: [f[:3] for f in request.fallbacks], empty=[])
    # An AdmitRequest is a tuple: zip turns the batch into its columns in one call.
    columns = list(zip(*requests, strict=True)) or [()] * len(AdmitRequest._fields)
    (
        tenants,
        routes,
        models,
        inputs,
        max_tokens,
        estimated,
        leases,
        keys,
        hashes,
        priorities,
        priority_any,
        degrade,
        _,  # fallbacks, flattened above
        output_reserves,
        _,  # output_strategy: the reserve says it all
        _,  # max_tokens_given: decided before the store
        key_ids,
        serving_paths,
        _,  # deployments, flattened below: position, model, name, rule
    ) = columns
    return (
        tenants,
        _or_null(routes),
        models,
        inputs,
        max_tokens,
        estimated,
        _or_null(leases),
        _or_null(keys),
        _or_null(hashes),
        concurrency_retry_ms,
        None
        if not any(priorities)
        else [None if p is None else priority_rank(p) for p in priorities],
        priority_any if any(priority_any) else None,
        _or_null(degrade),
        *alts[:3],  # p_alt_ord, p_alt_models, p_alt_inputs
        _or_null(output_reserves),
        _or_null(key_ids),
        _or_null(alts[3]),  # p_alt_outputs
        _or_null(serving_paths),
        *_flattened(requests, lambda request: request.deployments, empty=None),
    )


def _flattened(
    requests: Sequence[AdmitRequest],
    items: Callable[[AdmitRequest], Sequence[tuple[Any, ...]]],
    empty: list[Any] | None,
) -> list[Any]:
    """Each request's `items` as columns of one array each, the request's position
    (from 1) first: lq_admit's grouped arrays (p_alt_*, p_up_*); `empty` each
    column when no request has any."""
    rows = [
        (position, *item)
        for position, request in enumerate(requests, start=1)
        for item in items(request)
    ]
    if not rows:
        return [empty] * 4
    return [list(column) for column in zip(*rows, strict=True)]


def finish_arguments(requests: Sequence[FinishRequest]) -> tuple[list[Any], ...]:
    """lq_finish's arrays, one element per request, in its argument order."""
    return (
        [r.reservation_id for r in requests],
        [r.action for r in requests],
        [r.caller for r in requests],
        [r.input_tokens for r in requests],
        [r.output_tokens for r in requests],
        [r.outcome for r in requests],
        [r.usage_source for r in requests],
        # numeric in the database: a provider's figure may exceed any bigint
        [r.reported_input_tokens for r in requests],
        [r.reported_output_tokens for r in requests],
        [r.serving_path for r in requests],
    )


def _or_null(column: Sequence[Any]) -> Sequence[Any] | None:
    """A column with no value as one NULL array: lq_admit reads a NULL array as all
    NULL, and asyncpg then encodes nothing per element (its array encoder checks
    each one, the biggest Python cost of a statement's arguments)."""
    return None if all(value is None for value in column) else column


# lq_admit's columns, in its RETURNS TABLE order. Rows are read by position
# (one unpacking instead of 36 lookups by name); admit_decisions checks each
# batch's column names against this first, so a reordered function fails
# loudly instead of mixing figures up.
ADMIT_COLUMNS = (
    "ord",
    "status",
    "reservation_id",
    "reserved_tokens",
    "lease_expires_at",
    "lease_generation",
    "limit_kind",
    "limit_scope",
    "retry_after_ms",
    "capacity",
    "remaining_tokens",
    "remaining_requests",
    "remaining_in_flight",
    "tenant_tokens_per_minute",
    "tenant_token_burst",
    "tenant_tokens",
    "tenant_requests_per_minute",
    "tenant_request_burst",
    "tenant_requests",
    "model",
    "input_tokens",
    "degraded",
    "reason",
    "ceiling",
    "utilization",
    "priority",
    "plan",
    "alt_max_tokens",
    "alt_models",
    "quota",
    "resets_at",
    "quota_timezone",
    "credit_balance",
    "binding_tokens_per_minute",
    "binding_token_burst",
    "binding_tokens",
    "upstream",
)


# The admit statement adds the database's clock after lq_admit's columns
# (queries.sql), read by position too.
DATABASE_NOW_COLUMN = len(ADMIT_COLUMNS)


def admit_decisions(rows: Sequence[Row]) -> list[AdmitDecision]:
    """A batch's rows of lq_admit as decisions, in order (columns past
    ADMIT_COLUMNS, such as the statement's database_now, are not read)."""
    if rows and tuple(rows[0].keys())[: len(ADMIT_COLUMNS)] != ADMIT_COLUMNS:
        raise RuntimeError(f"lq_admit returned columns {list(rows[0].keys())}, not ADMIT_COLUMNS")
    return [admit_decision(row) for row in rows]


def admit_decision(row: Sequence[Any]) -> AdmitDecision:
    """One row of lq_admit (in ADMIT_COLUMNS order) as a decision.

    Columns 1-12 (status .. remaining_in_flight) are AdmitDecision's first
    twelve fields in the same order and 13-18 TenantFigures' six; the rest
    are taken one by one (tests/unit/test_admit_rows.py checks each).
    """
    rank, alt_models, resets_at = row[25], row[28], row[30]
    return AdmitDecision._make(
        (
            *row[1:13],
            TenantFigures._make(row[13:19]),
            row[19],  # model
            row[20],  # input_tokens
            bool(row[21]),  # degraded
            row[22],  # reason
            row[23],  # ceiling
            row[24],  # utilization
            None if rank is None else priority_of(rank),
            row[26],  # plan
            row[27],  # alt_max_tokens
            tuple(alt_models) if alt_models else (),
            row[29],  # quota
            resets_at if resets_at is None else _local(resets_at, row[31]),
            row[32],  # credit_balance
            None if row[34] is None else TokenLayerFigures._make(row[33:36]),
            row[36],  # upstream
        )
    )


def _local(instant: datetime, zone: str | None) -> datetime:
    """A quota's reset instant in the quota's own time zone (its local midnight)."""
    if zone is None:
        return instant
    try:
        return instant.astimezone(ZoneInfo(zone))
    except ZoneInfoNotFoundError:  # a zone the server knows and Python does not: UTC
        return instant


def finish_results(rows: Sequence[Row]) -> list[FinishResult]:
    """lq_finish's rows (and lq_finish_outage's, the same columns), in order."""
    return [
        FinishResult(
            status=row["status"],
            state=row["state"],
            tenant=row["tenant"],
            charged_tokens=row["charged_tokens"],
            refunded_tokens=row["refunded_tokens"],
            late=row["late"],
            excess_tokens=row["excess_tokens"],
            forgiven_global_tokens=row["forgiven_global_tokens"],
            forgiven_ceiling_tokens=row["forgiven_ceiling_tokens"],
            model=row["model"],
            plan=row["plan"],
        )
        for row in rows
    ]
