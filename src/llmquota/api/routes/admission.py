"""Admission: admit, then settle, release or heartbeat the reservation; count.

These are the hot path a client calls around every provider request. Each
route authenticates, asks the Limiter, and renders its answer; a refusal
(429, 413) is rendered by llmquota.api.refusals, in the exact shape clients
branch on.

An admit with `max_wait_ms` may wait for room in its tenant's queue
(llmquota.admission.waiting). While it waits it gives its fair-share permit
back (a waiter holds no worker slot and no database connection), and a
watcher on the ASGI receive channel notices the client hanging up: the
request then leaves the queue, and an admission made just as it left is
released.

POST /v1/tokens/count takes an admit body and answers what admitting it
would count and reserve now (the same preparation, then the limiter's own
output estimate), with nothing decided or written.
"""

from __future__ import annotations

import functools
import uuid
from typing import Annotated

from fastapi import APIRouter, Body, Request
from fastapi.responses import Response
from starlette.types import Receive, Scope

from llmquota.admission.limiter import Limiter
from llmquota.admission.preview import count_admission
from llmquota.admission.reservation import Admission
from llmquota.admission.waiting import ClientLeft
from llmquota.api.auth import Caller
from llmquota.api.dependencies import CallerDep, LimiterDep, error_responses
from llmquota.api.disconnect import CLIENT_CLOSED_REQUEST, client_left
from llmquota.api.fairness import RELEASE_EARLY
from llmquota.api.headers import decision_headers
from llmquota.api.refusals import refusal_cause, refusal_response
from llmquota.api.schemas import (
    AdmitBody,
    AdmitResponse,
    CountResponse,
    HeartbeatBody,
    HeartbeatResponse,
    OutputEstimateUsed,
    ReleaseResponse,
    Remaining,
    SettleBody,
    SettleResponse,
)
from llmquota.domain.records import AdmitRequest
from llmquota.domain.vocabulary import Priority, lowered_from

router = APIRouter(tags=["admission"])

JSON_MEDIA_TYPE = "application/json"


@router.post(
    "/v1/admit", status_code=201, response_model=AdmitResponse, responses=error_responses(429)
)
async def admit(
    body: AdmitBody, caller: CallerDep, limiter: LimiterDep, request: Request
) -> Response:
    """Reserve input + max_tokens on every layer, or say which limit refused;
    with max_wait_ms, wait that long at most for room first."""
    return await admit_answer(body, caller, limiter, request.scope, request.receive)


async def admit_answer(
    body: AdmitBody, caller: Caller, limiter: Limiter, scope: Scope, receive: Receive
) -> Response:
    """The admit route's answer; llmquota.api.hotpaths calls it without FastAPI's routing.

    `receive`: the request's channel once its body is read (a waiter watches it
    for the client hanging up)."""
    prepared = await _prepared(body, caller, limiter)
    headers: dict[str, str] = {}
    waiting, on_queued = limiter.waiting, scope.get(RELEASE_EARLY)
    try:
        if body.max_wait_ms:
            wait_ms, left = body.max_wait_ms, client_left(receive)
            waited = await waiting.decide(prepared, wait_ms, left=left, on_queued=on_queued)
        else:  # answered at once, unless a ceiling's ladder step queues it
            left_later = functools.partial(client_left, receive)
            waited = await waiting.decide_at_once(prepared, left=left_later, on_queued=on_queued)
    except ClientLeft:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    admission = waited.admission
    if waited.waited_ms:
        headers["llmquota-waited-ms"] = str(waited.waited_ms)
    if waited.queue_full:
        headers["llmquota-wait-queue"] = "full"
    headers.update(decision_headers(admission.decision))
    if admission.fallback is not None:
        # Decided by the failure mode while the store was away.
        headers["llmquota-fallback"] = admission.fallback
    refused = refusal_response(body.tenant, admission.decision, headers, body.priority)
    if refused is not None:
        return refused
    admission.raise_for_refusal(body.tenant)  # unknown tenant, idempotency conflict
    # pydantic's own JSON encoder, one call: the same bytes as dumping the model
    # to a dict and that through json (no floats here), at half the CPU.
    return Response(
        _admitted(admission, body.model, body.priority).model_dump_json().encode(),
        status_code=201,
        headers=headers,
        media_type=JSON_MEDIA_TYPE,
    )


async def _prepared(body: AdmitBody, caller: Caller, limiter: Limiter) -> AdmitRequest:
    """The admit body authorized, validated and counted (admit and count alike), as
    the caller's key asks it."""
    caller.require_tenant(body.tenant)
    caller.require_admission()
    limiter.refuse_suspended(body.tenant)  # also when the admin key asks
    if body.max_wait_ms is not None:
        limiter.waiting.check(body.max_wait_ms)  # 422 before any counting
    prepared = await limiter.prepare_off_loop(
        tenant=body.tenant,
        route=body.route,
        model=body.model,
        max_tokens=body.max_tokens,
        messages=body.messages,
        input_tokens=body.input_tokens,
        lease_seconds=body.lease_seconds,
        idempotency_key=body.idempotency_key,
        priority=body.priority,
        priority_any=caller.is_admin,
        fallback_models=body.fallback_models,
        degrade=body.degrade,
        upstreams=body.upstreams,
        upstream_rule=body.upstream_rule,
    )
    return caller.admitting(prepared)  # the key's own limits; 403 for a model it may not use


@router.post("/v1/tokens/count", response_model=CountResponse)
async def count_tokens(body: AdmitBody, caller: CallerDep, limiter: LimiterDep) -> CountResponse:
    """What POST /v1/admit would count and reserve for this body now, reserving nothing.

    The same body, key and refusals of the body as admit's; the figures are
    the requested model's (a fallback an admission degrades to counts its own
    input and reserves its own output estimate).
    """
    counted = await count_admission(limiter, await _prepared(body, caller, limiter))
    reserved = counted.reserved_tokens
    return CountResponse(
        input_tokens=counted.input_tokens,
        input_estimated=counted.input_estimated,
        reserved_tokens=reserved,
        output_estimate=OutputEstimateUsed(
            strategy=counted.output_strategy, tokens=reserved - counted.input_tokens
        ),
    )


def _admitted(
    admission: Admission, requested_model: str, requested_priority: Priority | None
) -> AdmitResponse:
    d = admission.decision

    assert d.reservation_id is not None and d.lease_expires_at is not None
    return AdmitResponse(
        reservation_id=str(d.reservation_id),
        reserved_tokens=int(d.reserved_tokens or 0),
        input_tokens=d.input_tokens if d.input_tokens is not None else admission.input_tokens,
        input_estimated=admission.input_estimated,
        output_estimate=OutputEstimateUsed(**admission.output_estimate),
        lease_expires_at=d.lease_expires_at,
        lease_generation=int(d.lease_generation or 1),
        remaining=Remaining(
            tokens=d.remaining_tokens,
            requests=d.remaining_requests,
            permits=d.remaining_in_flight,
            in_flight=d.remaining_in_flight,
        ),
        model=d.model or requested_model,
        degraded=d.degraded,
        degraded_from=requested_model if d.degraded else None,
        degraded_because=refusal_cause(d) if d.degraded and d.limit_kind else None,
        priority=d.priority,
        priority_lowered_from=lowered_from(requested_priority, d.priority),
        upstream=d.upstream,
    )


@router.post(
    "/v1/reservations/{reservation_id}/settle",
    response_model=SettleResponse,
    responses=error_responses(409),
)
async def settle(
    reservation_id: uuid.UUID, body: SettleBody, caller: CallerDep, limiter: LimiterDep
) -> SettleResponse:
    """Charge the provider's reported usage; refund or debit the difference."""
    return await settle_answer(reservation_id, body, caller, limiter)


async def settle_answer(
    reservation_id: uuid.UUID, body: SettleBody, caller: Caller, limiter: Limiter
) -> SettleResponse:
    """The settle route's answer; llmquota.api.hotpaths calls it without FastAPI's routing."""
    # A suspended tenant still settles: money must land.
    caller.require_scope("admit")
    result = await limiter.settle(
        reservation_id,
        input_tokens=body.input_tokens,
        output_tokens=body.output_tokens,
        outcome=body.outcome,
        caller=caller.scope,
    )
    return SettleResponse(
        charged_tokens=result.charged_tokens,
        refunded_tokens=result.refunded_tokens,
        late=result.late,
    )


@router.post(
    "/v1/reservations/{reservation_id}/release",
    response_model=ReleaseResponse,
    responses=error_responses(409),
)
async def release(
    reservation_id: uuid.UUID, caller: CallerDep, limiter: LimiterDep
) -> ReleaseResponse:
    """Give the whole reservation back: the provider was never called."""
    caller.require_scope("admit")
    await limiter.release(reservation_id, caller=caller.scope)
    return ReleaseResponse(released=True)


@router.post(
    "/v1/reservations/{reservation_id}/heartbeat",
    response_model=HeartbeatResponse,
    responses=error_responses(409),
)
async def heartbeat(
    reservation_id: uuid.UUID,
    caller: CallerDep,
    limiter: LimiterDep,
    body: Annotated[HeartbeatBody | None, Body()] = None,
) -> HeartbeatResponse:
    """Extend a live lease."""
    caller.require_scope("admit")
    result = await limiter.heartbeat(
        reservation_id,
        lease_seconds=body.lease_seconds if body else None,
        caller=caller.scope,
        lease_generation=body.lease_generation if body else None,
    )
    assert result.lease_expires_at is not None and result.lease_generation is not None
    return HeartbeatResponse(
        lease_expires_at=result.lease_expires_at, lease_generation=result.lease_generation
    )
