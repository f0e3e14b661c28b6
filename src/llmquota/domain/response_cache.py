"""The response cache tier of proxy mode: its policy, its keys and its similarity.

Pure code. Seed 001 puts a cache first in the serving chain ("it can
realistically handle 30-40% of all requests"): a request whose answer is
already known is answered from it, costs the provider nothing and is served
even when the tenant's budget is spent. A policy opts in (tenant, route or
plan: `"cache": {...}`); nothing is cached without one.

- **exact**: the key is a SHA-256 of the request in a canonical form: the
  endpoint, the model and every body member that can change the answer
  (`ANSWER_NEUTRAL` lists those that cannot, such as `stream`). Two
  requests that differ only in member order or white space share a key.
- **semantic**: the exact key first (free), then the nearest earlier
  request of the same context whose last user turn is close enough: an
  embedding of that turn (from `embedding_model`, through the configured
  upstreams, charged to the tenant like any request), compared by cosine
  with those stored in the tenant's namespace; served at or above
  `similarity`. The *context* is everything but that turn's text (system
  prompt, earlier turns, parameters), hashed: a paraphrase matches only
  within the same conversation shape.

The similarity scan is bounded twice: by the namespace (tenant, route,
endpoint, model and context, at most `max_entries` of a tenant) and by a
64-bit SimHash signature of each embedding (random hyperplanes, fixed
seed): candidates are those within `SIGNATURE_MAX_DISTANCE` bits, and only
they are compared exactly. Two unit vectors at angle t differ in each bit
with probability t/pi, so a pair at cosine 0.92 (23 degrees) differs in 8.2
bits on average (sd 2.7): the cut at 20 keeps such a pair with probability
above 0.999, and an unrelated pair (90 degrees: 32 bits, sd 4) passes it
with probability below 0.002.

A sampled request (temperature above 0, or none given: both providers
default to 1) has no single answer, so it is never cached unless the policy
says `"sampled": true`.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
from collections.abc import Mapping, Sequence
from decimal import Decimal
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    StrictBool,
    StrictFloat,
    WithJsonSchema,
    model_validator,
)
from pydantic.config import JsonDict

from llmquota.domain.json_numbers import WholeNumber
from llmquota.domain.json_schemas import present
from llmquota.domain.money import money_text
from llmquota.domain.names import ModelName

CacheMode = Literal["exact", "semantic"]
MAX_TTL_SECONDS = 30 * 86_400
DEFAULT_TTL_SECONDS = 3_600
MAX_ENTRIES = 100_000
DEFAULT_MAX_ENTRIES = 1_000
DEFAULT_SIMILARITY = 0.92
# The most a hit may be priced at, in USD (a typo guard, like policy.py's).
MAX_HIT_PRICE_USD = Decimal("1000")
HIT_PRICE_PLACES = 6
# A hit's price as the API takes it: a decimal string, as every amount of
# money (a JSON number would have lost digits before anyone read it), from 0
# to MAX_HIT_PRICE_USD with at most HIT_PRICE_PLACES places. The schema
# shows this pattern, so it states the bounds a string must keep.
HIT_PRICE_PATTERN = r"^((0|[1-9][0-9]{0,2})(\.[0-9]{1,6})?|1000(\.0{1,6})?)$"
_HIT_PRICE = re.compile(HIT_PRICE_PATTERN)
HIT_PRICE_RULE = (
    f'a decimal string such as "0.0001", from 0 to {MAX_HIT_PRICE_USD} with at most '
    f"{HIT_PRICE_PLACES} decimal places"
)
# A stored answer larger than this is not cached (the row stays small).
MAX_CACHED_BODY_BYTES = 1_048_576
# The most dimensions an embedding may have (the largest models: 3,072).
MAX_EMBEDDING_DIMENSIONS = 8_192

# Body members that never change the answer: transport, accounting and
# tracing options. Everything else is part of the key.
ANSWER_NEUTRAL = frozenset(
    {"stream", "stream_options", "user", "metadata", "store", "service_tier", "safety_identifier"}
)

SIGNATURE_BITS = 64
SIGNATURE_MAX_DISTANCE = 20
_SIGNATURE_SEED = 0x6C6D7175  # "lmqu": the hyperplanes are the same in every worker


def _hit_price(value: object) -> object:
    """A price string as its Decimal, without trailing zeros (a Decimal given in
    Python as it is); anything else, a JSON number among them, refused with the rule."""
    if isinstance(value, Decimal):
        return value
    if isinstance(value, str) and _HIT_PRICE.fullmatch(value):
        return Decimal(money_text(Decimal(value)))  # exact: the pattern allows 6 places
    raise ValueError(f"must be {HIT_PRICE_RULE}")


# Shown as money_text writes every amount ("0.0001", "2"): however it was
# spelt in the PUT ("0.00010", "2.0"), a GET answers one form, and a PUT of
# that answer stores the same.
HitPriceUsd = Annotated[
    Decimal,
    Field(ge=0, le=MAX_HIT_PRICE_USD, decimal_places=HIT_PRICE_PLACES),
    BeforeValidator(_hit_price),
    PlainSerializer(money_text, return_type=str, when_used="json"),
    WithJsonSchema({"type": "string", "pattern": HIT_PRICE_PATTERN, "description": HIT_PRICE_RULE}),
]

# The rule between mode and embedding_model, as JSON Schema (the validator
# below says it to pydantic): semantic needs a model, exact takes none.
_SEMANTIC_NEEDS_A_MODEL: JsonDict = {
    "allOf": [
        {
            "if": {"required": ["mode"], "properties": {"mode": {"const": "semantic"}}},
            "then": present("embedding_model", "string"),
        },
        {
            "if": {"required": ["mode"], "properties": {"mode": {"const": "exact"}}},
            "then": {"properties": {"embedding_model": {"type": "null"}}},
        },
    ]
}


class CachePolicy(BaseModel):
    """A policy's `cache` member: whether and how proxy answers are reused."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, json_schema_extra=_SEMANTIC_NEEDS_A_MODEL
    )

    mode: CacheMode
    ttl_seconds: Annotated[int, WholeNumber(ge=1, le=MAX_TTL_SECONDS)] = DEFAULT_TTL_SECONDS
    max_entries: Annotated[int, WholeNumber(ge=1, le=MAX_ENTRIES)] = DEFAULT_MAX_ENTRIES
    # semantic only: the least cosine similarity served, and the model whose
    # embeddings compare the last user turns
    similarity: Annotated[StrictFloat, Field(gt=0.0, le=1.0)] = DEFAULT_SIMILARITY
    # (a model name as a request names one: it goes upstream as such)
    embedding_model: ModelName | None = None
    # cache requests sampled at a temperature above 0 (or none given)
    sampled: StrictBool = False
    # serve a hit while the tenant's budget is spent (the point of the tier)
    serve_when_exhausted: StrictBool = True
    # what a hit costs the tenant, written to its ledger row (USD)
    hit_price_usd: HitPriceUsd | None = None

    @model_validator(mode="after")
    def _semantic_needs_a_model(self) -> CachePolicy:
        if self.mode == "semantic" and self.embedding_model is None:
            raise ValueError("cache.embedding_model is required for mode semantic")
        if self.mode == "exact" and self.embedding_model is not None:
            raise ValueError("cache.embedding_model is only for mode semantic")
        return self


def parse_cache_policy(text: str | Mapping[str, Any] | None) -> CachePolicy | None:
    """A stored `cache` (JSON text or object), or None when unset or not understood
    (a member this worker does not know: caching nothing is always safe)."""
    if not text:
        return None
    try:
        if isinstance(text, str):
            return CachePolicy.model_validate_json(text)
        return CachePolicy.model_validate(text)
    except ValueError:
        return None


def is_sampled(body: Mapping[str, Any]) -> bool:
    """Whether the request samples (temperature above 0, or none given)."""
    temperature = body.get("temperature")
    if temperature is None:
        return True
    return not (isinstance(temperature, int | float) and temperature <= 0)


def _canonical(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _kept(body: Mapping[str, Any]) -> dict[str, Any]:
    """The members that are part of a key: the answer-changing ones, and whether
    the answer streams (a stream and a whole answer are stored apart, each
    replayed as the provider sent it)."""
    kept = {k: v for k, v in body.items() if k not in ANSWER_NEUTRAL and k != "model"}
    kept["stream"] = body.get("stream") is True
    return kept


def exact_key(endpoint: str, model: str, body: Mapping[str, Any]) -> bytes:
    """The exact key of a request: SHA-256 of its answer-changing members, canonical."""
    return hashlib.sha256(_canonical([endpoint, model, _kept(body)])).digest()


def last_user_text(body: Mapping[str, Any]) -> str | None:
    """The text of the last user turn (its text parts joined), or None when the
    last message is not a user's or holds no text."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    last = messages[-1]
    if not isinstance(last, dict) or last.get("role") != "user":
        return None
    content = last.get("content")
    if isinstance(content, str):
        return content or None
    if isinstance(content, list):
        texts = [
            part["text"]
            for part in content
            if isinstance(part, dict)
            and part.get("type") == "text"
            and isinstance(part.get("text"), str)
        ]
        if len(texts) == len(content) and texts:
            return "\n".join(texts)
    return None


def context_key(endpoint: str, model: str, body: Mapping[str, Any], embedding_model: str) -> bytes:
    """What a semantic match must share: the exact key with the last user turn's
    text left out (its other members, such as a `name`, stay), and the model
    whose embeddings are compared (vectors of two models are never compared)."""
    messages = list(body.get("messages") or [])
    kept = _kept(body)
    last = messages[-1] if messages and isinstance(messages[-1], dict) else {}
    kept["messages"] = [*messages[:-1], {**last, "content": None}]
    return hashlib.sha256(_canonical(["semantic", endpoint, model, embedding_model, kept])).digest()


def unit(vector: Sequence[float]) -> list[float]:
    """`vector` scaled to length 1 (cosine is then a dot product); raises ValueError
    for a vector of zeros or with a value that is not finite."""
    norm = math.sqrt(math.fsum(x * x for x in vector))
    if not norm or not math.isfinite(norm):
        raise ValueError("an embedding must be finite and not all zeros")
    return [x / norm for x in vector]


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """The cosine similarity of two unit vectors of one length (0.0 otherwise)."""
    if len(a) != len(b):
        return 0.0
    return math.fsum(x * y for x, y in zip(a, b, strict=True))


_planes: dict[int, tuple[tuple[int, ...], ...]] = {}


def _hyperplanes(dimensions: int) -> tuple[tuple[int, ...], ...]:
    """SIGNATURE_BITS sparse random hyperplanes for `dimensions` (Achlioptas's
    {-1, 0, +1} with probabilities 1/6, 2/3, 1/6), as signed 1-based indices:
    +i adds x[i-1], -i subtracts it. Same seed, same planes, in every worker."""
    planes = _planes.get(dimensions)
    if planes is None:
        rng = random.Random(_SIGNATURE_SEED * 100_003 + dimensions)
        built = []
        for _ in range(SIGNATURE_BITS):
            plane = []
            for i in range(1, dimensions + 1):
                draw = rng.random()
                if draw < 1 / 6:
                    plane.append(i)
                elif draw < 1 / 3:
                    plane.append(-i)
            built.append(tuple(plane))
        planes = _planes[dimensions] = tuple(built)
    return planes


def signature(vector: Sequence[float]) -> int:
    """The SimHash of an embedding: bit k set when it lies on the positive side of
    hyperplane k; as a signed 64-bit integer (PostgreSQL's bigint)."""
    bits = 0
    for k, plane in enumerate(_hyperplanes(len(vector))):
        side = 0.0
        for i in plane:
            side += vector[i - 1] if i > 0 else -vector[-i - 1]
        if side >= 0.0:
            bits |= 1 << k
    return bits - (1 << SIGNATURE_BITS) if bits >= 1 << (SIGNATURE_BITS - 1) else bits
