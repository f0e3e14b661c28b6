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

Deployments (issue 23): the decision names, for the requested model and each
explicit fallback, the deployments that serve it (Proxy.admission_deployments),
and lq_admit chooses one in the same statement as every other limit, so a
ceiling scoped to one deployment (its `upstream`) is charged only for what
goes there, and traffic beyond it spills to the next exactly. The answer says
which served (`llmquota-upstream`). A deployment that then answers 429 or
5xx hands the request on through a decision of its own among those not yet
tried (`next_deployment`), the first reservation released, so the next
deployment's ceiling is charged and nothing is charged twice.
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
from llmquota.domain.errors import InvalidRequest, LimiterError
from llmquota.domain.records import AdmitRequest, FallbackCandidate
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
    # The request as decided (its deployments), for a hand-over's own decision.
    prepared: AdmitRequest


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
    proxy: Proxy = request.app.state.proxy
    tenant = str(caller.tenant)
    fallbacks = _fallbacks(kind, proxy, request)
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
        models = [prepared.model, *(f.model for f in prepared.fallbacks)]
        prepared = prepared._replace(deployments=proxy.admission_deployments(kind, models))
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
        kind, request, prepared, parsed, raw, admission=admission, headers=headers
    )
    if isinstance(admitted, Admitted) and waited_ms and admitted.path == "primary":
        admitted = dataclasses.replace(admitted, path="queued")
    elif admission.decision.status in REFUSALS:
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
    prepared: AdmitRequest,
    parsed: ProxyRequest,
    raw: bytes,
    *,
    admission: Admission,
    headers: dict[str, str],
) -> Admitted | Response:
    """The answer to a decision: its refusal, or the request as it goes upstream
    (to the deployment the decision chose, else the model's first)."""
    limiter: Limiter = request.app.state.limiter
    proxy: Proxy = request.app.state.proxy
    tenant, decision = prepared.tenant, admission.decision
    refused = refusal(kind, tenant, decision)
    if refused is not None:
        refused.headers.update(headers)
        return refused
    if decision.status != "admitted":
        return error_response(kind, 403, f"tenant {tenant!r} has no policy in llmquota")
    # Fenced: the stream's heartbeats come from a task of their own.
    reservation = Reservation(limiter, tenant, admission, fence=True)
    model = decision.model or parsed.model
    upstream = proxy.upstreams.get(decision.upstream or "") or proxy.route(kind, model)
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
    elif _spilled(prepared, decision.upstream, proxy.deployments(kind, model)):
        path = "second_deployment"
    exchange = Exchange(reservation, model, limiter.settings.estimate_factors)
    return Admitted(exchange, parsed, upstream, content, headers, path, prepared)


def _spilled(prepared: AdmitRequest, chosen: str | None, ranked: list[Upstream]) -> bool:
    """Whether the request goes to another deployment than the first: lq_admit
    passed over the first it was given for want of room (and journals
    second_deployment), or the routing rule's first is cooled down (given
    last; the settlement names the path then). Never under least_utilized,
    whose choice is the balance it asks for."""
    first = next((d for d in prepared.deployments if d.model == prepared.model), None)
    if first is None or first.rule != "order" or chosen is None:
        return False
    return chosen != first.upstream or (bool(ranked) and chosen != ranked[0].name)


async def next_deployment(
    request: Request, admitted: Admitted, tried: frozenset[str], untried: Upstream
) -> Upstream | None:
    """The deployment to hand a request on to after one answered 429 or 5xx, by a
    decision of its own among the model's deployments not yet `tried` (the
    reservation so far released first: that deployment charged nothing), so
    that the next one's ceilings are charged, exactly and once. The exchange
    then holds the new reservation. None: none admits it now, or the limiter
    cannot say (the last answer stands). A failure mode's admission (the store
    away) names no deployment: the next `untried` in the chain's order serves."""
    proxy: Proxy = request.app.state.proxy
    limiter: Limiter = request.app.state.limiter
    exchange, kind = admitted.exchange, admitted.upstream.kind
    deployments = proxy.admission_deployments(kind, [exchange.model], skip=tried)
    await exchange.release()
    again = _as_admitted(admitted.prepared, exchange)._replace(
        deployments=deployments, serving_path="second_deployment"
    )
    try:  # a hand-over, not an answer of its own: not counted as one
        admission = await limiter.decide(again, answer=False, recall=False)
    except LimiterError:
        return None
    if admission.decision.status != "admitted":
        return None
    exchange.reservation = Reservation(limiter, again.tenant, admission, fence=True)
    exchange.finished = False
    chosen = admission.decision.upstream
    return untried if chosen is None else proxy.upstreams[chosen]


def _as_admitted(prepared: AdmitRequest, exchange: Exchange) -> AdmitRequest:
    """`prepared` as the model its exchange serves: a fallback's own input and
    output reserve when it was an explicit one; never degraded again (the body
    already names the model), never answered from memory, no idempotency key
    (the first reservation was its admission)."""
    decision = exchange.decision
    request = prepared._replace(fallbacks=(), degrade=False, idempotency_key=None)
    if exchange.model == prepared.model:
        return request
    own = next((f for f in prepared.fallbacks if f.model == exchange.model), None)
    fallback = own or FallbackCandidate(
        exchange.model, decision.input_tokens or prepared.input_tokens, prepared.output_reserve
    )
    return request._replace(
        model=fallback.model,
        input_tokens=fallback.input_tokens,
        output_reserve=fallback.output_reserve,
        output_strategy=fallback.output_strategy if own else prepared.output_strategy,
    )


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
