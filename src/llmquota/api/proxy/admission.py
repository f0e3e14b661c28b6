"""A proxy request's admission: counted, degraded and waited for as /v1/admit's is.

Degradation (issue 23): the policy's fallback models, or the client's own in
`llmquota-fallback-models` (comma-separated, in order), apply to proxy
requests. When the requested model is refused, the first fallback that fits
every layer is admitted in the same statement (exactly as for /v1/admit),
the body goes upstream naming it, and the answer says what was asked in
`llmquota-degraded-from`. A fallback the client names must be served by an
upstream of the request's format (else 400 naming it, before anything is
reserved); a policy's default that no upstream of that format serves is not
used: the request is answered the refusal the requested model got, and what
was admitted for it is released. `llmquota-degrade: false` keeps the model
as written. `llmquota-max-wait-ms` waits for room like /v1/admit's
`max_wait_ms` (at most MAX_WAIT_MS_CAP), with the same queue and the same
`llmquota-waited-ms` and `llmquota-wait-queue` answers.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass

from fastapi import Request, Response

from llmquota.admission.limiter import Admission, Limiter
from llmquota.admission.reservation import Reservation
from llmquota.admission.waiting import ClientLeft
from llmquota.api.auth import Caller, Forbidden
from llmquota.api.disconnect import CLIENT_CLOSED_REQUEST, client_left
from llmquota.api.fairness import RELEASE_EARLY
from llmquota.api.proxy.exchange import Exchange
from llmquota.api.proxy.requests import BadProxyRequest, ProxyRequest
from llmquota.api.proxy.upstream import Proxy, Upstream, unserved_model
from llmquota.api.proxy.wire import Kind, error_response, refusal
from llmquota.domain.errors import InvalidRequest
from llmquota.domain.records import AdmitRequest
from llmquota.domain.refusal_table import REFUSALS
from llmquota.domain.vocabulary import ServingPath

FALLBACKS_HEADER = "llmquota-fallback-models"
DEGRADE_HEADER = "llmquota-degrade"
MAX_WAIT_HEADER = "llmquota-max-wait-ms"


@dataclass(frozen=True, slots=True)
class Admitted:
    """An admitted proxy request: its exchange, the request as it goes upstream
    (the admitted model in its body), the upstream serving that model, and the
    headers the answer adds."""

    exchange: Exchange
    parsed: ProxyRequest
    upstream: Upstream
    content: bytes
    headers: dict[str, str]
    path: ServingPath


async def admit_proxied(
    kind: Kind,
    request: Request,
    caller: Caller,
    parsed: ProxyRequest,
    raw: bytes,
    *,
    started: float,
) -> Admitted | Response:
    """Count and decide (the key's own limits, fallbacks, waiting); the refusal to
    answer (counted as serving path `rejected`, timed from `started`), or the
    admitted request. Raises BadProxyRequest for a bad header."""
    limiter: Limiter = request.app.state.limiter
    tenant = str(caller.tenant)
    fallbacks = _fallbacks(kind, request.app.state.proxy, request)
    max_wait_ms = _max_wait_ms(request)
    try:
        if max_wait_ms is not None:
            limiter.waiting.check(max_wait_ms)
        prepared = await limiter.prepare_off_loop(
            tenant=tenant,
            route=request.headers.get("llmquota-route"),
            model=parsed.model,
            max_tokens=parsed.max_tokens,
            max_tokens_given=parsed.max_tokens_given,
            messages=parsed.messages,
            input_tokens=parsed.input_tokens,
            fallback_models=fallbacks,
            degrade=_degrade(request),
        )
        prepared = caller.admitting(prepared)
    except InvalidRequest as exc:
        raise BadProxyRequest(400, str(exc)) from None
    except Forbidden as exc:
        return error_response(kind, 403, str(exc), param="model")
    headers: dict[str, str] = {}
    decided = await _decide(limiter, prepared, request, max_wait_ms, headers)
    if isinstance(decided, Response):
        return decided
    admission, waited_ms = decided
    admitted = await _admitted(
        kind, request, tenant, parsed, raw, admission=admission, headers=headers
    )
    if isinstance(admitted, Admitted) and waited_ms and admitted.path == "primary":
        admitted = dataclasses.replace(admitted, path="queued")
    elif admission.decision.status in REFUSALS:
        proxy: Proxy = request.app.state.proxy
        proxy.metrics.served("rejected", started)
    return admitted


async def _decide(
    limiter: Limiter,
    prepared: AdmitRequest,
    request: Request,
    max_wait_ms: int | None,
    headers: dict[str, str],
) -> tuple[Admission, int] | Response:
    """The decision and how long it waited for room (adding the waiting's headers);
    or, for a client that left while waiting, the answer nobody reads."""
    waiting, on_queued = limiter.waiting, request.scope.get(RELEASE_EARLY)
    try:
        if max_wait_ms:
            left = client_left(request.receive)
            waited = await waiting.decide(prepared, max_wait_ms, left=left, on_queued=on_queued)
        else:  # answered at once, unless a ceiling's ladder step queues it
            left_later = functools.partial(client_left, request.receive)
            waited = await waiting.decide_at_once(prepared, left=left_later, on_queued=on_queued)
    except ClientLeft:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    if waited.waited_ms:
        headers["llmquota-waited-ms"] = str(waited.waited_ms)
    if waited.queue_full:
        headers["llmquota-wait-queue"] = "full"
    return waited.admission, waited.waited_ms


async def _admitted(
    kind: Kind,
    request: Request,
    tenant: str,
    parsed: ProxyRequest,
    raw: bytes,
    *,
    admission: Admission,
    headers: dict[str, str],
) -> Admitted | Response:
    """The answer to a decision: its refusal, or the request as it goes upstream."""
    limiter: Limiter = request.app.state.limiter
    proxy: Proxy = request.app.state.proxy
    decision = admission.decision
    refused = refusal(kind, tenant, decision)
    if refused is not None:
        refused.headers.update(headers)
        return refused
    if decision.status != "admitted":
        return error_response(kind, 403, f"tenant {tenant!r} has no policy in llmquota")
    # Fenced: the stream's heartbeats come from a task of their own.
    reservation = Reservation(limiter, tenant, admission, fence=True)
    model = decision.model or parsed.model
    upstream = proxy.route(kind, model)
    if upstream is None:
        # A policy default no upstream of this format serves: the requested
        # model's refusal, which the decision still describes.
        await reservation.release()
        answer = refusal(kind, tenant, decision._replace(status="rate_limited"))
        assert answer is not None
        return answer
    content = raw
    path: ServingPath = "primary"
    if model != parsed.model:
        path = "fallback_model"
        headers["llmquota-degraded-from"] = parsed.model
        parsed = dataclasses.replace(parsed, body={**parsed.body, "model": model}, model=model)
        content = json.dumps(parsed.body).encode()
    exchange = Exchange(reservation, model, limiter.settings.estimate_factors)
    return Admitted(exchange, parsed, upstream, content, headers, path)


def _fallbacks(kind: Kind, proxy: Proxy, request: Request) -> list[str] | None:
    """The client's fallback models, each served by an upstream of `kind`; None: the
    policy's."""
    value = request.headers.get(FALLBACKS_HEADER)
    if value is None:
        return None
    models = [m.strip() for m in value.split(",") if m.strip()]
    for model in models:
        if proxy.route(kind, model) is None:
            raise BadProxyRequest(400, f"{FALLBACKS_HEADER}: {unserved_model(kind, model)}")
    return models


def _degrade(request: Request) -> bool | None:
    value = request.headers.get(DEGRADE_HEADER)
    if value is None:
        return None
    if value not in ("true", "false"):
        raise BadProxyRequest(400, f"{DEGRADE_HEADER} must be true or false")
    return value == "true"


def _max_wait_ms(request: Request) -> int | None:
    value = request.headers.get(MAX_WAIT_HEADER)
    if value is None:
        return None
    if not value.isascii() or not value.isdigit():
        raise BadProxyRequest(400, f"{MAX_WAIT_HEADER} must be a whole number of milliseconds")
    return int(value)
