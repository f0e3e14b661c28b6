"""Turning what a caller asks for into an AdmitRequest: validated and counted.

Pure. The library, the REST endpoint and the CLI hand their arguments here,
so every path refuses the same values with the same words and counts input
tokens the same way before anything reaches the store.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping, Sequence
from typing import Any, Required, TypedDict

from llmquota.domain.errors import InvalidRequest
from llmquota.domain.model_limits import max_output_tokens
from llmquota.domain.names import UPSTREAM_NAME_RULE, is_upstream_name
from llmquota.domain.plans import MAX_FALLBACK_MODELS, check_model_list
from llmquota.domain.records import AdmitRequest, Deployment, FallbackCandidate
from llmquota.domain.tokens import (
    PIECE_CHARS,
    UNLIMITED_SECONDS,
    CpuBudget,
    TokenCountError,
    count_messages,
    message_chars,
)
from llmquota.domain.validation import (
    MAX_TOKEN_COUNT,
    check_idempotency_key,
    check_lease_seconds,
    check_model,
    check_name,
    check_token_count,
)
from llmquota.domain.vocabulary import DEPLOYMENT_RULES, PRIORITIES, DeploymentRule, Priority

# The most deployments a request may name for its model.
MAX_UPSTREAMS = 16


class AdmitArguments(TypedDict, total=False):
    """What a caller asks admission for, before it is validated and counted."""

    tenant: Required[str]
    model: Required[str]
    # None: the model's maximum output (model_limits.py), and admission
    # reserves the learned estimate where it has one.
    max_tokens: int | None
    max_tokens_given: bool
    messages: Sequence[Mapping[str, Any]] | None
    input_tokens: int | None
    route: str | None
    lease_seconds: int | None
    idempotency_key: str | None
    priority: Priority | None
    priority_any: bool
    fallback_models: Sequence[str] | None
    degrade: bool | None
    # The tenant's API key the request is made with: its own limits and quotas apply.
    key_id: int | None
    # The deployments that may serve the requested model, in order, and how
    # admission chooses among them (records.Deployment).
    upstreams: Sequence[str] | None
    upstream_rule: DeploymentRule | None


def prepare_admit_request(
    *,
    tenant: str,
    model: str,
    estimate_factors: Mapping[str, float],
    max_tokens: int | None = None,
    max_tokens_given: bool = True,
    messages: Sequence[Mapping[str, Any]] | None = None,
    input_tokens: int | None = None,
    route: str | None = None,
    lease_seconds: int | None = None,
    idempotency_key: str | None = None,
    priority: Priority | None = None,
    priority_any: bool = False,
    fallback_models: Sequence[str] | None = None,
    degrade: bool | None = None,
    count_cpu_seconds: float = UNLIMITED_SECONDS,
    request_hash_key: bytes | None = None,
    key_id: int | None = None,
    upstreams: Sequence[str] | None = None,
    upstream_rule: DeploymentRule | None = None,
) -> AdmitRequest:
    """Validate and count a request; raises InvalidRequest. Counting stops encoding
    after `count_cpu_seconds` of this thread's CPU and bounds the rest from above
    (an estimate, tokens.py); `request_hash_key` keys an idempotent request's digest.
    """
    _check_names(tenant, route, model)
    _check_options(lease_seconds, idempotency_key, priority)
    max_tokens, max_tokens_given = _output_limit(model, max_tokens, max_tokens_given)
    if (messages is None) == (input_tokens is None):
        raise InvalidRequest("give exactly one of messages or input_tokens")
    models = _fallback_models(model, fallback_models)
    deployments = _deployments(model, upstreams, upstream_rule)
    counted, estimated, fallbacks = _count_each(
        model, models, messages, input_tokens, estimate_factors, count_cpu_seconds
    )
    request_hash = None
    if idempotency_key is not None:
        asked = [route, model, max_tokens, lease_seconds, input_tokens, messages]
        asked += _given([priority, list(models), degrade, list(deployments)])
        request_hash = _request_hash(asked, request_hash_key)
    return AdmitRequest(
        tenant=tenant,
        route=route,
        model=model,
        input_tokens=counted,
        max_tokens=max_tokens,
        input_estimated=estimated,
        lease_seconds=lease_seconds,
        idempotency_key=idempotency_key,
        request_hash=request_hash,
        priority=priority,
        priority_any=priority_any,
        degrade=degrade,
        fallbacks=fallbacks,
        max_tokens_given=max_tokens_given,
        key_id=_key_id(key_id),
        deployments=deployments,
    )


def _deployments(
    model: str, upstreams: Sequence[str] | None, rule: DeploymentRule | None
) -> tuple[Deployment, ...]:
    """The requested model's deployments, checked: bounded, distinct, each a name of
    printable characters; the rule one of DEPLOYMENT_RULES (default `order`)."""
    if rule is not None and rule not in DEPLOYMENT_RULES:
        raise InvalidRequest(f"upstream_rule must be one of {', '.join(DEPLOYMENT_RULES)}")
    if upstreams is None:
        return ()
    if isinstance(upstreams, str) or not isinstance(upstreams, Sequence):
        raise InvalidRequest("upstreams must be a list of upstream names")
    if not 0 < len(upstreams) <= MAX_UPSTREAMS:
        raise InvalidRequest(f"upstreams: 1 to {MAX_UPSTREAMS} names")
    for name in upstreams:
        if not is_upstream_name(name):
            raise InvalidRequest(f"upstreams: each {UPSTREAM_NAME_RULE}")
    if len(set(upstreams)) != len(upstreams):
        raise InvalidRequest("upstreams: each name once")
    return tuple(Deployment(model, name, rule or "order") for name in upstreams)


def _given(options: list[Any]) -> list[Any]:
    """What a digest adds of [priority, fallbacks, degrade, deployments]: the first
    three when any is given, the deployments when given, so that a request
    without them has the digest it had before they existed."""
    priority, models, degrade, deployments = options
    added = [priority, models, degrade] if priority or models or degrade is False else []
    return added + ([deployments] if deployments else [])


def _key_id(key_id: object) -> int | None:
    """An API key's id: a positive integer (bigint), or None."""
    if key_id is None:
        return None
    if isinstance(key_id, bool) or not isinstance(key_id, int) or not 0 < key_id < 2**63:
        raise InvalidRequest("key_id must be a positive integer (an API key's id)")
    return key_id


def _check_names(tenant: str, route: str | None, model: str) -> None:
    """The request's names, each refused naming it."""
    check_name("tenant", tenant)
    if route is not None:
        check_name("route", route)
    check_model(model)


def _check_options(
    lease_seconds: int | None, idempotency_key: str | None, priority: Priority | None
) -> None:
    """The request's plain options, each refused naming it."""
    check_lease_seconds(lease_seconds)
    check_idempotency_key(idempotency_key)
    if priority is not None and priority not in PRIORITIES:
        raise InvalidRequest(f"priority must be one of {', '.join(PRIORITIES)}")


def _output_limit(model: str, max_tokens: int | None, given: bool) -> tuple[int, bool]:
    """(max_tokens, whether the caller gave it); none given: the model's published maximum."""
    if max_tokens is not None:
        return check_token_count("max_tokens", max_tokens), given
    ceiling = max_output_tokens(model)
    if ceiling is None:
        raise InvalidRequest(
            f"give max_tokens: model {model!r} has no known maximum output (domain/model_limits.py)"
        )
    return ceiling, False


def _count_each(  # noqa: PLR0917 (one private call site)
    model: str,
    fallback_models: tuple[str, ...],
    messages: Sequence[Mapping[str, Any]] | None,
    input_tokens: int | None,
    estimate_factors: Mapping[str, float],
    count_cpu_seconds: float,
) -> tuple[int, bool, tuple[FallbackCandidate, ...]]:
    """(input tokens, whether estimated, each fallback with its input tokens).

    Each fallback is counted with its own tokenizer: encodings differ by model.
    A caller's own input_tokens stands for every model.
    """
    if input_tokens is not None:
        counted = check_token_count("input_tokens", input_tokens)
        if not fallback_models:
            return counted, False, ()
        return counted, False, tuple(FallbackCandidate(m, counted) for m in fallback_models)
    # The budget's clock starts here, and only when there is more than one
    # piece to count (a piece is encoded whole, whatever the budget): reading
    # a thread's CPU clock is a system call, and most requests are short.
    budget = CpuBudget(count_cpu_seconds) if _many_pieces(messages) else CpuBudget()
    counted, estimated = _count(messages or [], model, estimate_factors, budget)
    fallbacks = tuple(
        FallbackCandidate(m, _count(messages or [], m, estimate_factors, budget)[0])
        for m in fallback_models
    )
    return counted, estimated, fallbacks


def _fallback_models(model: str, fallback_models: Sequence[str] | None) -> tuple[str, ...]:
    """The explicit fallback list, checked: bounded, distinct, never the requested model."""
    if fallback_models is None:
        return ()
    if isinstance(fallback_models, str) or not isinstance(fallback_models, Sequence):
        raise InvalidRequest("fallback_models must be a list of model names")
    if len(fallback_models) > MAX_FALLBACK_MODELS:
        raise InvalidRequest(f"fallback_models: at most {MAX_FALLBACK_MODELS} models")
    for name in fallback_models:
        check_model(name, "fallback_models")
    try:
        check_model_list("fallback_models", list(fallback_models), requested=model)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from exc
    return tuple(fallback_models)


def _many_pieces(messages: Sequence[Mapping[str, Any]] | None) -> bool:
    """Whether the messages' text is longer than one piece (a malformed list
    counts as long: counting it then refuses it, with the reason)."""
    try:
        return message_chars(messages or []) > PIECE_CHARS
    except (TokenCountError, TypeError):
        return True


def _count(
    messages: Sequence[Mapping[str, Any]],
    model: str,
    estimate_factors: Mapping[str, float],
    budget: CpuBudget,
) -> tuple[int, bool]:
    """(input tokens, whether estimated) of chat messages, within MAX_TOKEN_COUNT."""
    try:
        count = count_messages(messages, model, estimate_factors, budget)
    except TokenCountError as exc:
        raise InvalidRequest(str(exc)) from exc
    if count.tokens > MAX_TOKEN_COUNT:
        raise InvalidRequest(f"messages hold more than {MAX_TOKEN_COUNT} tokens")
    return count.tokens, count.estimated


def request_hash_key(server_key: bytes) -> bytes:
    """The key of request hashes, derived from the server's own key (outage_id_key):
    one secret in the database, a separate key for each use."""
    return hmac.new(server_key, b"llmquota request_hash v1", hashlib.sha256).digest()


def _request_hash(fields: list[Any], key: bytes | None) -> str:
    """A digest of what an idempotent request asked for, to tell a replay from a reuse.

    An HMAC under a server secret, not a bare SHA-256: the digest is stored
    with the reservation, and a bare hash of the messages would let whoever
    reads the table confirm a guessed prompt. Without the key (a worker that
    has not reached the database yet) it is the bare SHA-256, so such a worker
    still tells replays from reuses of its own."""
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=repr).encode()
    if key is None:
        return hashlib.sha256(canonical).hexdigest()
    return hmac.new(key, canonical, hashlib.sha256).hexdigest()
