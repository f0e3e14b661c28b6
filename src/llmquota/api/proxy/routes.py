"""POST /v1/chat/completions and POST /v1/messages: admission around a provider call.

Each request is authenticated by the tenant's llmquota key (`Authorization:
Bearer` as the openai SDK sends it, `x-api-key` as the anthropic SDK does),
read and counted (requests.py), decided on every layer, and refused in the
provider's own format, or forwarded with llmquota's provider key. What the
provider answers settles the reservation (exchange.py); a stream is relayed
as it arrives (stream.py). POST /v1/messages/count_tokens is read and
counted the same way and answered in Anthropic's format, reserving nothing
(or passed upstream, as PROXY_COUNT_TOKENS says).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass, field

import httpx
from fastapi import APIRouter, Request, Response

from llmquota.admin.service import AdminService
from llmquota.api.fairness import RELEASE_EARLY
from llmquota.api.proxy import cache
from llmquota.api.proxy.admission import Admitted, admit_proxied, next_deployment
from llmquota.api.proxy.answers import (
    passed_back,
    pool_refused,
    upstream_error,
    upstream_failed,
    upstream_request,
)
from llmquota.api.proxy.callers import read_request
from llmquota.api.proxy.cooldown import retry_after_seconds
from llmquota.api.proxy.counting import count_tokens_answer
from llmquota.api.proxy.exchange import Exchange, UsageTracker
from llmquota.api.proxy.metrics import CallMetrics
from llmquota.api.proxy.pool import PoolRefusal, Slot
from llmquota.api.proxy.requests import BadProxyRequest, ProxyRequest
from llmquota.api.proxy.stream import RelayResponse, StreamRelay
from llmquota.api.proxy.upstream import (
    Chain,
    Proxy,
    Upstream,
)
from llmquota.api.proxy.wire import (
    Endpoint,
    Kind,
    error_response,
    kind_of,
    limit_headers,
)
from llmquota.domain.errors import LimiterError, StoreUnavailable
from llmquota.domain.json_limits import loads_bounded
from llmquota.domain.vocabulary import ServingPath

log = logging.getLogger("llmquota.proxy")


def proxy_router(proxy_enabled: dict[Kind, bool]) -> APIRouter:
    """The proxy endpoints; in the OpenAPI document only where an upstream is configured."""
    router = APIRouter(tags=["proxy"])

    @router.post("/v1/chat/completions", include_in_schema=proxy_enabled["openai"])
    async def chat_completions(request: Request) -> Response:
        """OpenAI's chat completions, admitted, forwarded and settled."""
        return await _handle("chat", request)

    @router.post("/v1/completions", include_in_schema=proxy_enabled["openai"])
    async def completions(request: Request) -> Response:
        """OpenAI's legacy completions, admitted, forwarded and settled."""
        return await _handle("completions", request)

    @router.post("/v1/embeddings", include_in_schema=proxy_enabled["openai"])
    async def embeddings(request: Request) -> Response:
        """OpenAI's embeddings: input tokens only, settled from the provider's count."""
        return await _handle("embeddings", request)

    @router.post("/v1/messages", include_in_schema=proxy_enabled["anthropic"])
    async def messages(request: Request) -> Response:
        """Anthropic's messages, admitted, forwarded and settled."""
        return await _handle("messages", request)

    @router.post("/v1/messages/count_tokens", include_in_schema=proxy_enabled["anthropic"])
    async def count_tokens(request: Request) -> Response:
        """Anthropic's token count, reserving nothing: counted here as /v1/messages is,
        or the upstream's own (LLMQUOTA_PROXY_COUNT_TOKENS=upstream)."""
        return await count_tokens_answer(request)

    return router


async def _handle(endpoint: Endpoint, request: Request) -> Response:
    """Authenticate, read, route; answer from the cache (cache.py), or admit, then
    forward (or answer why not)."""
    kind = kind_of(endpoint)
    started = time.perf_counter()
    try:
        read = await read_request(endpoint, request)
        if isinstance(read, Response):
            return read
        caller, parsed, _upstream = read
        # The tenant's answers already sent may still be settling (settles.py):
        # every admission below (the semantic cache's embedding too) comes after.
        await request.app.state.proxy.settles.behind(str(caller.tenant))
        lookup = await cache.lookup_for(request, caller, endpoint, parsed)
        if lookup is not None and lookup.policy.serve_when_exhausted:
            # Before admission: a hit costs the provider nothing, so a spent budget
            # does not stop it.
            served, lookup = await cache.serve(kind, request, caller, lookup, parsed, started)
            if served is not None:
                return served
        body = await request.body()
        admitted = await admit_proxied(kind, request, caller, parsed, body, started=started)
    except BadProxyRequest as exc:
        return error_response(kind, exc.status, str(exc), param=exc.param)
    except StoreUnavailable as exc:
        return error_response(kind, 503, str(exc), headers={"retry-after": "1"})
    if isinstance(admitted, Response):
        return admitted
    # Admitted: from here the tenant's max_in_flight bounds it, not the worker's fair share.
    release_fair_share = request.scope.get(RELEASE_EARLY)
    if release_fair_share is not None:
        release_fair_share()
    try:
        if admitted.path == "fallback_model":
            lookup = None  # another model's answer is never stored as the requested one's
        elif lookup is not None and not lookup.policy.serve_when_exhausted:
            # The policy serves hits only within the budget: looked up once
            # admitted; a hit gives back what was reserved (below).
            holding = admitted.exchange.reservation_id
            served, lookup = await cache.serve(
                kind, request, caller, lookup, parsed, started, holding=holding
            )
            if served is not None:
                return served
        return await _forward(endpoint, request, admitted, lookup, started)
    finally:
        if not admitted.exchange.handed_over:
            # A no-op once settled; after any failure, nothing was produced for the client.
            await asyncio.shield(admitted.exchange.release())


async def _forward(
    endpoint: Endpoint,
    request: Request,
    admitted: Admitted,
    lookup: cache.CacheLookup | None,
    started: float,
) -> Response:
    """Send an admitted request to the model's deployments until one answers:
    first the one its admission chose, then on a 429 or 5xx the next
    (Proxy.chain: the routing rule's rank, the cooled down last; decided again
    when the admission chose, see next_deployment), each at most once and all
    within one deadline; when no other may follow, the last error is the answer."""
    kind = kind_of(endpoint)
    proxy: Proxy = request.app.state.proxy
    exchange, parsed = admitted.exchange, admitted.parsed
    headers = limit_headers(kind, exchange.decision) | admitted.headers
    if exchange.fallback is not None:
        headers["llmquota-fallback"] = exchange.fallback  # as /v1/admit says it
    chain = proxy.chain(kind, exchange.model, first=admitted.upstream.name)
    upstream: Upstream | None = admitted.upstream
    path: ServingPath = admitted.path
    while upstream is not None:
        path = admitted.path if not chain.tried else "second_deployment"
        headers["llmquota-upstream"] = upstream.name
        headers[cache.SERVING_PATH_HEADER] = path
        # (the journal says how it was admitted; a deployment after the first says more)
        exchange.serving_path = "second_deployment" if path == "second_deployment" else None
        call = Call(
            proxy, upstream, endpoint, request, exchange, headers, admitted.content, chain, lookup
        )
        try:
            answer = await (_stream(call, parsed) if parsed.stream else _complete(call))
            break
        except _TryNext as failed:
            answer = failed.answer  # nothing produced
            chain.tried.add(upstream.name)
            in_time = chain.time_for_another()
            upstream = await _handed_on(request, admitted, chain) if in_time else None
            if upstream is None:
                await exchange.release()
            if failed.response is not None:  # after any release: it must not refill them
                await _cool_down_on_429(call, failed.response, scoped_only=True)
    proxy.metrics.served(path, started)
    return answer


async def _handed_on(request: Request, admitted: Admitted, chain: Chain) -> Upstream | None:
    """The next deployment: by a decision of its own when a ceiling of the model is
    scoped to one deployment (and the admission chose among them), else the
    same reservation goes to the next in the chain's order, as every ceiling of
    the model already counts it."""
    exchange, limiter = admitted.exchange, request.app.state.limiter
    untried = chain.next_untried()
    scoped = limiter.policies.scoped_to_deployment(exchange.model)
    if untried is None or exchange.decision.upstream is None or not scoped:
        return untried
    return await next_deployment(request, admitted, frozenset(chain.tried), untried)


class _TryNext(Exception):
    """The deployment answered 429 or 5xx, or nothing, and another serves the
    model: try it, or answer `answer` if no time is left for it."""

    def __init__(self, answer: Response, response: httpx.Response | None = None) -> None:
        super().__init__(answer.status_code)
        self.answer = answer
        self.response = response  # the provider's answer, if it gave one


@dataclass(frozen=True, slots=True)
class Call:
    """One admitted request on its way upstream."""

    proxy: Proxy
    upstream: Upstream
    endpoint: Endpoint
    request: Request
    exchange: Exchange
    headers: dict[str, str]
    content: bytes  # the body as it goes upstream (the admitted model's)
    # the request's deployments, in the order tried, and their deadline
    chain: Chain
    # where a successful answer is stored, when the response cache keeps it
    cache: cache.CacheLookup | None = None
    # when it was sent (time.monotonic(), cooldown.py's clock)
    sent_at: float = field(default_factory=time.monotonic)

    def metrics(self) -> CallMetrics:
        """The observations of the upstream call about to be sent, timed from now."""
        return self.proxy.metrics.call(self.upstream.kind, self.endpoint)

    def outgoing(self, content: bytes) -> httpx.Request:
        """The upstream request: the body, our key, the provider's own headers."""
        return upstream_request(self.proxy, self.upstream, self.endpoint, self.request, content)

    async def connection(self) -> Slot:
        """A slot of the upstream's pool for this tenant (pool.py); raises PoolRefusal."""
        return await self.proxy.shares[self.upstream.name].acquire(self.exchange.reservation.tenant)

    def in_time(self) -> asyncio.Timeout:
        """What is left of the request's deadline, to bound the wait for an answer."""
        return asyncio.timeout_at(self.chain.deadline)

    def refused(self, response: httpx.Response) -> Response:
        """The answer to a provider's error; on a 429 or 5xx, remembered against the
        deployment (cooldown.py), and _TryNext raised when a later one may serve.

        Nothing was produced: the reservation is released or handed on
        (_handed_on). On a 429, the ceilings scoped to this deployment are
        cooled (_cool_down_on_429, in _forward); those of every deployment
        only by the last one's 429, as they bound the next one too.
        """
        answer = upstream_error(self.upstream.kind, self.upstream, response, self.headers)
        if response.status_code != 429 and response.status_code < 500:
            self.answered()  # the request's fault (a 400), not the deployment's
            return answer
        self._failed(response.status_code == 429, retry_after_seconds(response.headers))
        if self.chain.later(self.upstream):
            raise _TryNext(answer, response)
        return answer

    def unanswered(self, exc: httpx.HTTPError | TimeoutError) -> Response:
        """No answer (no connection, a timeout): a 502 or 504, handed on as a 5xx
        is. The request's deadline running out is not held against the deployment."""
        answer = upstream_failed(self.upstream.kind, exc, self.headers)
        if not isinstance(exc, TimeoutError):
            self._failed(False, None)
        if self.chain.later(self.upstream):
            raise _TryNext(answer)
        return answer

    def answered(self) -> None:
        """The deployment answered well: its count of failures starts again."""
        if self.chain.cools:
            self.proxy.cooldowns.answered(self.upstream.name, self.exchange.model, self.sent_at)

    def _failed(self, refused: bool, retry_after: float | None) -> None:
        if not self.chain.cools:
            return  # nothing to try instead: the ceilings' cooldown is the one
        cooldowns, name, model = self.proxy.cooldowns, self.upstream.name, self.exchange.model
        record = cooldowns.refused if refused else cooldowns.failed
        if record(name, model, time.monotonic(), retry_after):
            self.proxy.metrics.cooled(name)
            log.warning("deployment %r of %r cooled down: tried after the others", name, model)


async def _cool_down_on_429(
    call: Call, response: httpx.Response, *, scoped_only: bool = False
) -> None:
    """An upstream 429: the provider's own limit is reached, whatever our ceilings say.

    With PROXY_CEILING_COOLDOWN_SECONDS set, the ceilings of the model that
    bound this deployment (scoped to it, or to none) are emptied for the
    provider's retry-after (or that setting), so llmquota refuses the model
    there meanwhile instead of sending requests the provider will refuse.
    `scoped_only`: another deployment takes the request, so only the ceilings
    scoped to this one. Best effort: the client's answer never waits on it
    failing.
    """
    setting = call.proxy.settings.proxy_ceiling_cooldown_seconds
    if response.status_code != 429 or setting <= 0:
        return
    if not scoped_only:
        # The request ends here, nothing produced: what it held goes back first,
        # so that the give-back never refills the ceilings emptied below.
        await call.exchange.release()
    seconds = retry_after_seconds(response.headers) or setting
    admin: AdminService = call.request.app.state.admin
    try:
        await admin.cool_down_ceilings(
            call.exchange.model, min(seconds, 3_600.0), call.upstream.name, scoped_only=scoped_only
        )
    except LimiterError as exc:
        log.warning("ceiling cool-down for %r not recorded: %s", call.exchange.model, exc)


async def _complete(call: Call) -> Response:
    """Forward a whole request; pass the provider's body through unchanged."""
    kind, upstream, headers = call.upstream.kind, call.upstream, call.headers
    outgoing, calls = call.outgoing(call.content), call.metrics()
    try:
        slot = await call.connection()
    except PoolRefusal as exc:
        return pool_refused(kind, exc, headers)
    try:
        async with call.in_time():
            # Streamed, to time the response head apart from the body.
            response = await call.proxy.client(upstream).send(outgoing, stream=True)
        try:
            calls.answered(response.status_code)
            # The head came in time: the body is not cut by the request's
            # deadline (the provider bills it), only by the read timeout.
            await response.aread()
        finally:
            await response.aclose()
    except (httpx.HTTPError, TimeoutError) as exc:
        calls.failed(exc)
        return call.unanswered(exc)
    finally:
        slot.release()
    if response.status_code >= 400:
        answer = call.refused(response)
        await _cool_down_on_429(call, response)
        return answer
    call.answered()
    tracker = UsageTracker(kind)
    with contextlib.suppress(ValueError):
        tracker.read_body(loads_bounded(response.content))
    # Settled right behind the answer, not before it (settles.py).
    call.exchange.handed_over = True
    call.proxy.settles.start(call.exchange.reservation.tenant, call.exchange.finish(tracker, "ok"))
    if call.cache is not None and response.status_code == 200:
        cache.keep(call.request, call.cache, upstream.scrub(response.content), tracker)
    return Response(
        upstream.scrub(response.content),
        status_code=response.status_code,
        headers={**upstream.scrub_headers(passed_back(response)), **headers},
        media_type=response.headers.get("content-type"),
    )


async def _stream(call: Call, parsed: ProxyRequest) -> Response:
    """Open the provider's stream; relay it from a pump that settles at its end."""
    kind, upstream, headers, proxy = call.upstream.kind, call.upstream, call.headers, call.proxy
    body, hold_back = parsed.body, False
    options = body.get("stream_options")
    if kind == "openai" and not parsed.client_wants_usage and isinstance(options, dict | None):
        # Ask for the usage chunk to settle by, and keep it from a client that did not.
        body = {**body, "stream_options": {**(options or {}), "include_usage": True}}
        hold_back = True
    content = json.dumps(body).encode() if hold_back else call.content
    outgoing, calls = call.outgoing(content), call.metrics()
    try:
        slot = await call.connection()
    except PoolRefusal as exc:
        return pool_refused(kind, exc, headers)
    try:
        async with call.in_time():  # to the response head; the stream itself is not bounded
            response = await proxy.client(upstream).send(outgoing, stream=True)
    except (httpx.HTTPError, TimeoutError) as exc:
        slot.release()
        calls.failed(exc)
        return call.unanswered(exc)
    except BaseException:
        slot.release()
        raise
    calls.answered(response.status_code)
    if response.status_code >= 400:
        try:
            await response.aread()
        finally:
            await response.aclose()
            slot.release()
        answer = call.refused(response)
        await _cool_down_on_429(call, response)
        return answer
    call.answered()
    settings = proxy.settings
    relay = StreamRelay(
        call.exchange,
        response,
        UsageTracker(kind),
        hold_back_usage=hold_back,
        disconnect=settings.proxy_disconnect,
        drain_seconds=settings.proxy_drain_seconds,
        heartbeat_seconds=settings.proxy_heartbeat_seconds,
        stall_seconds=settings.proxy_client_stall_seconds,
        metrics=calls,
        scrub=upstream.scrub,
        slot=slot,
        on_complete=cache.keeper(call.request, call.cache, upstream.scrub),
    )
    relay.start(proxy.pumps)
    call.exchange.handed_over = True
    return RelayResponse(
        relay,
        headers={**upstream.scrub_headers(passed_back(response)), **headers},
        media_type=response.headers.get("content-type", "text/event-stream"),
    )
