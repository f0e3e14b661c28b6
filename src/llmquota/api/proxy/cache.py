"""The response cache tier: the first step of proxy mode's serving chain.

Seed 001's chain, when a tenant's budget or the provider's ceiling runs
short: the cache, else a cheaper model, else a queue, else a refusal. A
request whose tenant (or route, or plan) has a `cache` policy is looked up
here before it is admitted (domain/response_cache.py says how keys and
similarity work):

- a hit is answered from the stored answer, in the provider's own format
  (a stream replayed as the SSE events the provider sent), with
  `llmquota-serving-path: cache`; it is recorded in the ledger in the same
  statement that found it (0 tokens charged, what it saved, the policy's
  price for a hit) and never reaches admission, so it is served even when
  the tenant's budget is spent, unless the policy says
  `"serve_when_exhausted": false` (then the lookup waits for the admission,
  and a hit releases what was reserved);
- semantic mode embeds the last user turn first, with the policy's
  `embedding_model`, through the configured upstreams and admitted like any
  request of the tenant (a refusal only skips the semantic lookup);
- a miss goes on as before, and a successful answer (status 200, final usage
  reported) is stored in the background: the client never waits for it.

Entries belong to one tenant and route: a lookup never reads another's.
A streamed and a whole answer are kept apart (`stream` is part of the key),
so each is replayed byte for byte as the provider sent it.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

import httpx
from fastapi import Request, Response
from starlette.responses import StreamingResponse

from llmquota.admission.limiter import Limiter
from llmquota.admission.reservation import Reservation
from llmquota.api.auth import Caller
from llmquota.api.proxy.exchange import UsageTracker
from llmquota.api.proxy.pool import PoolRefusal
from llmquota.api.proxy.requests import ProxyRequest
from llmquota.api.proxy.stream import event_data, without_usage
from llmquota.api.proxy.upstream import Proxy, Upstream
from llmquota.api.proxy.wire import Endpoint, Kind
from llmquota.domain.errors import LimiterError
from llmquota.domain.json_limits import loads_bounded
from llmquota.domain.response_cache import (
    MAX_CACHED_BODY_BYTES,
    MAX_EMBEDDING_DIMENSIONS,
    CachePolicy,
    context_key,
    exact_key,
    is_sampled,
    last_user_text,
    signature,
    unit,
)
from llmquota.domain.upstream_usage import UpstreamUsage
from llmquota.store.response_cache import CacheHit, CacheKey

log = logging.getLogger(__name__)

SERVING_PATH_HEADER = "llmquota-serving-path"
# The most of an embeddings answer read (an 8,192-dimension vector in JSON is
# about 200 KB): a larger one is refused before it is parsed.
MAX_EMBEDDING_ANSWER_BYTES = 1_048_576
SIMILARITY_HEADER = "llmquota-cache-similarity"
# The endpoints whose answers are cached: generations. Embeddings and
# legacy completions pass through.
CACHED_ENDPOINTS: frozenset[Endpoint] = frozenset({"chat", "messages"})


@dataclass(frozen=True, slots=True)
class CacheLookup:
    """A request the cache may answer: its policy and its key."""

    policy: CachePolicy
    key: CacheKey


async def lookup_for(
    request: Request, caller: Caller, endpoint: Endpoint, parsed: ProxyRequest
) -> CacheLookup | None:
    """The cache lookup of a request, or None when no policy caches it (none set,
    an endpoint not cached, a sampled request the policy does not cache)."""
    if endpoint not in CACHED_ENDPOINTS or caller.tenant is None:
        return None
    if caller.models is not None and caller.models.first_refused([parsed.model]) is not None:
        return None  # admission answers the key's 403, as without a cache
    limiter: Limiter = request.app.state.limiter
    if len(limiter.journal):
        # An outage is being recorded: the store did not answer lately, and a
        # lookup would spend the decision deadline before admission's own
        # failure mode answers. The cache waits for the store to be back.
        return None
    route = request.headers.get("llmquota-route")
    policy = await limiter.cache_policy(str(caller.tenant), route)
    if policy is None or (is_sampled(parsed.body) and not policy.sampled):
        return None
    key = CacheKey(
        tenant=str(caller.tenant),
        route=route,
        endpoint=endpoint,
        model=parsed.model,
        exact_key=exact_key(endpoint, parsed.model, parsed.body),
    )
    return CacheLookup(policy, key)


async def serve(  # noqa: PLR0917 (the request's parts, as the proxy has them)
    kind: Kind,
    request: Request,
    caller: Caller,
    lookup: CacheLookup,
    parsed: ProxyRequest,
    started: float,
    *,
    holding: uuid.UUID | None = None,
) -> tuple[Response | None, CacheLookup]:
    """The answer from the cache (counted as serving path `cache`, timed from
    `started`), or None; and the lookup as it is now (with the semantic key once
    embedded, for storing a fresh answer under it). `holding`: the request's own
    reservation, when it was admitted first (what it holds is room for a priced
    hit, which gives it back)."""
    limiter: Limiter = request.app.state.limiter
    policy = lookup.policy
    budget = limiter.deadline_seconds
    answers = limiter.store.response_cache
    semantic = False
    try:
        hit = await answers.serve(
            lookup.key,
            similarity=policy.similarity,
            price_usd=policy.hit_price_usd,
            budget_seconds=budget,
            key_id=caller.key_id,
            reservation_id=holding,
        )
        if hit is None and policy.mode == "semantic":
            lookup = await _embedded(request, caller, lookup, parsed)
            if lookup.key.embedding is not None:
                semantic = True
                hit = await answers.serve(
                    lookup.key,
                    similarity=policy.similarity,
                    price_usd=policy.hit_price_usd,
                    budget_seconds=budget,
                    key_id=caller.key_id,
                    reservation_id=holding,
                )
    except LimiterError as exc:
        # The cache is an optimisation: a store that does not answer it sends
        # the request the usual way (which then meets the same store).
        log.warning("response cache lookup failed: %s", exc)
        return None, lookup
    if hit is None:
        return None, lookup
    proxy: Proxy = request.app.state.proxy
    proxy.metrics.served("cache", started)
    return replay(kind, hit, parsed, semantic=semantic), lookup


def replay(kind: Kind, hit: CacheHit, parsed: ProxyRequest, *, semantic: bool) -> Response:
    """A stored answer in the provider's format, with the cache's headers."""
    headers = {SERVING_PATH_HEADER: "cache", "llmquota-cache-hit": str(hit.hit_id)}
    if semantic:
        headers[SIMILARITY_HEADER] = f"{hit.similarity:.4f}"
    if not parsed.stream:
        return Response(hit.answer, headers=headers, media_type="application/json")
    hide_usage = kind == "openai" and not parsed.client_wants_usage
    return StreamingResponse(
        _events(hit.answer, hide_usage=hide_usage),
        headers=headers,
        media_type="text/event-stream",
    )


async def _events(transcript: bytes, *, hide_usage: bool) -> AsyncIterator[bytes]:
    """The stored events, as the client asked for them: without OpenAI's usage
    chunk (and the `"usage": null` of the others) when it did not ask for usage."""
    for raw in transcript.split(b"\n\n"):
        if not raw.strip():
            continue
        event = raw + b"\n\n"
        if hide_usage:
            data = event_data(event)
            if isinstance(data, dict) and data.get("choices") == [] and data.get("usage"):
                continue
            event = without_usage(event, data)
        yield event


async def _embedded(
    request: Request, caller: Caller, lookup: CacheLookup, parsed: ProxyRequest
) -> CacheLookup:
    """The lookup with its semantic key: the last user turn embedded by the
    policy's model, admitted and settled as the tenant's own request. Unchanged
    when there is no such turn, the key may not use that model, no upstream
    serves it, or the embedding is refused or fails."""
    text = last_user_text(parsed.body)
    model = lookup.policy.embedding_model
    if text is None or model is None:
        return lookup
    if caller.models is not None and caller.models.first_refused([model]) is not None:
        return lookup
    vector = await _embed(request, caller, lookup.key.route, model, text)
    if vector is None:
        return lookup
    key = replace(
        lookup.key,
        context_key=context_key(lookup.key.endpoint, lookup.key.model, parsed.body, model),
        embedding=vector,
        signature=signature(vector),
    )
    return replace(lookup, key=key)


async def _embed(
    request: Request, caller: Caller, route: str | None, model: str, text: str
) -> list[float] | None:
    """`text` embedded by `model` (length 1), admitted and settled as the caller's
    tenant's own request of that model (never degraded to another: its tokens
    are priced as the embedding model's); None when it cannot be had. A call
    the provider answered with its usage is settled whatever its vector is,
    through the outage journal if the store does not answer; one that never
    answered is released."""
    proxy: Proxy = request.app.state.proxy
    limiter: Limiter = request.app.state.limiter
    upstream = proxy.route("openai", model)
    if upstream is None:
        log.warning("cache.embedding_model %r: no upstream serves it", model)
        return None
    tenant = str(caller.tenant)
    try:
        reservation = await limiter.admit(
            tenant=tenant,
            route=route,
            model=model,
            max_tokens=0,
            messages=[{"role": "user", "content": text}],
            key_id=caller.key_id,
            degrade=False,
        )
    except LimiterError:
        return None  # refused (or no store): no semantic lookup this time
    answer: tuple[list[float] | None, int] | None = None
    try:
        answer = await _call_embeddings(proxy, upstream, tenant, model, text)
    except (httpx.HTTPError, PoolRefusal, ValueError) as exc:
        log.warning("cache embedding by %r failed: %s", model, exc)
    finally:
        if answer is None:
            await asyncio.shield(_release(reservation))
        else:
            usage = UpstreamUsage(input_tokens=answer[1], output_tokens=0, source="reported")
            await asyncio.shield(_settle(reservation, usage))
    vector = None if answer is None else answer[0]
    try:
        return None if vector is None else unit(vector)
    except ValueError:
        return None


async def _release(reservation: Reservation) -> None:
    try:
        await reservation.release()
    except LimiterError as exc:
        log.warning("could not release reservation %s: %s", reservation.reservation_id, exc)


async def _settle(reservation: Reservation, usage: UpstreamUsage) -> None:
    try:
        await reservation.settle_upstream(usage)
    except LimiterError as exc:
        log.error("cache embedding %s not settled: %s", reservation.reservation_id, exc)


async def _call_embeddings(
    proxy: Proxy, upstream: Upstream, tenant: str, model: str, text: str
) -> tuple[list[float] | None, int]:
    """One OpenAI embeddings call: the vector (None when not one the cache can
    use) and the input tokens the provider counted. Raises ValueError for an
    answer without a usable token count, or larger than MAX_EMBEDDING_ANSWER_BYTES."""
    client = proxy.client(upstream)
    outgoing = client.build_request(
        "POST",
        upstream.url("embeddings"),
        json={"model": model, "input": text, "encoding_format": "float"},
        headers=upstream.headers({}),
        timeout=upstream.timeout or client.timeout,
    )
    slot = await proxy.shares[upstream.name].acquire(tenant)
    try:
        response = await client.send(outgoing, stream=True)
        try:
            content = bytearray()
            async for chunk in response.aiter_bytes():
                content += chunk
                if len(content) > MAX_EMBEDDING_ANSWER_BYTES:
                    raise ValueError("the embeddings answer is larger than the cache reads")
        finally:
            await response.aclose()
    finally:
        slot.release()
    if response.status_code != 200:
        raise ValueError(f"the embeddings upstream answered {response.status_code}")
    body: Any = loads_bounded(bytes(content))
    try:
        tokens = body["usage"]["prompt_tokens"]
    except (KeyError, TypeError):
        raise ValueError("the embeddings answer has no usage.prompt_tokens") from None
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
        raise ValueError("the embeddings answer's prompt_tokens is not a count")
    try:
        vector = body["data"][0]["embedding"]
    except (KeyError, IndexError, TypeError):
        return None, tokens
    if (
        not isinstance(vector, list)
        or not 0 < len(vector) <= MAX_EMBEDDING_DIMENSIONS
        or not all(isinstance(x, int | float) and not isinstance(x, bool) for x in vector)
    ):
        return None, tokens
    return [float(x) for x in vector], tokens


def keeper(
    request: Request, lookup: CacheLookup | None, scrub: Callable[[bytes], bytes]
) -> Callable[[bytes, UsageTracker], None] | None:
    """What a stream that ran to its end does with its transcript (the events as
    the provider sent them): keep it, scrubbed. None when nothing is cached."""
    if lookup is None:
        return None
    cached = lookup

    def keep_transcript(transcript: bytes, tracker: UsageTracker) -> None:
        keep(request, cached, scrub(transcript), tracker)

    return keep_transcript


def keep(request: Request, lookup: CacheLookup, answer: bytes, tracker: UsageTracker) -> None:
    """Store a successful answer in the background, if it is complete and small
    enough: the final usage reported as plain counts, the provider's own body."""
    input_tokens, output_tokens = tracker.reported_input, tracker.reported_output
    if not (
        tracker.final
        and not tracker.failed
        and _count(input_tokens)
        and _count(output_tokens)
        and 0 < len(answer) <= MAX_CACHED_BODY_BYTES
    ):
        return
    assert isinstance(input_tokens, int) and isinstance(output_tokens, int)
    proxy: Proxy = request.app.state.proxy
    limiter: Limiter = request.app.state.limiter
    task = asyncio.get_running_loop().create_task(
        _store(limiter, lookup, answer, input_tokens, output_tokens)
    )
    proxy.pumps.add(task)
    task.add_done_callback(proxy.pumps.discard)


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


async def _store(
    limiter: Limiter, lookup: CacheLookup, answer: bytes, input_tokens: int, output_tokens: int
) -> None:
    """Keep an answer; a failure is logged and costs only the next hit (the task
    runs in the background: nobody else would hear of it)."""
    policy = lookup.policy
    try:
        await limiter.store.response_cache.store(
            lookup.key,
            answer,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            ttl_seconds=policy.ttl_seconds,
            max_entries=policy.max_entries,
            deadline_seconds=limiter.deadline_seconds,
        )
    except Exception:
        log.exception("response cache store failed")
