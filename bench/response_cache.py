"""Comparison 11: the response cache of proxy mode (issue 23), replayed on a trace.

Seed 001 expects a cache in front of the provider to answer 30-40% of
requests. Whether it does depends on the traffic, so the bench replays one:
a seeded trace of questions with a Zipf-like popularity, where a repeated
question comes back either verbatim or as a paraphrase (its case or its
punctuation changed, or one word dropped). Verbatim repeats are what an exact
cache can serve; paraphrases only a semantic one can.

The fake provider of the proxy tests (tests/proxy/fake_provider.py, 16 words
an answer, 5 ms before each streamed word, bag-of-words embeddings so that a
paraphrase lies close to its question) runs in a process of its own, and
llmquota in proxy mode (bench/proxy_overhead.py's server) in front of it on
the bench's PostgreSQL. Three fresh tenants, so that no cache serves
another's trace: one without a cache (the baseline), one with an exact
cache, one with a semantic cache. The official openai SDK (AsyncOpenAI)
replays the trace against all three at once, request by request in turn
(the order rotating), CONCURRENCY requests in flight, so the machine's drift
touches the three alike. Each request streams (temperature 0, so it is
cacheable) and its latency is the time to the stream's end.

Reported per tenant: the hit rate (the answers' `llmquota-serving-path`
header, checked against the ledger's rows with `serving_path = 'cache'`), the
tokens the hits saved and the tokens charged (the ledger's; the semantic
tenant's embedding calls are charged to it), and what a miss adds: the p50
and p99 of a miss in each cache mode minus those of the baseline (where every
request is a miss) on the same asks, and the median of the two's differences
ask by ask.
"""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import asyncpg
import openai
from tests.proxy.fake_provider import bag_of_words

from bench import proxy_overhead
from bench.common import Report, fresh_database, machine_load, percentile

Mode = Literal["none", "exact", "semantic"]
MODES: tuple[Mode, ...] = ("none", "exact", "semantic")
AskKind = Literal["first", "verbatim", "paraphrase"]

MODEL = "gpt-4o"
EMBEDDING_MODEL = "text-embedding-3-small"
SIMILARITY = 0.85
MAX_TOKENS = 64
# Long enough that nothing expires during a run; max_entries stays at its
# default (1,000), above the distinct texts of either trace.
TTL_SECONDS = 3_600
CACHE_POLICIES: dict[Mode, dict[str, Any] | None] = {
    "none": None,
    "exact": {"mode": "exact", "ttl_seconds": TTL_SECONDS},
    "semantic": {
        "mode": "semantic",
        "ttl_seconds": TTL_SECONDS,
        "embedding_model": EMBEDDING_MODEL,
        "similarity": SIMILARITY,
    },
}
SERVING_PATH_HEADER = "llmquota-serving-path"
# Requests in flight at once, over the three tenants: a few users, not a load
# test (the proxy's throughput is comparison proxy_overhead's business).
CONCURRENCY = 4
# Sampled requests per tenant before the trace (never cached: no temperature),
# so that no tenant's first measured request pays for a cold connection.
WARMUP = 5
SEED = 23
ZIPF_EXPONENT = 1.0
# Of the repeats, the share asked verbatim; the others are paraphrased.
VERBATIM_SHARE = 0.5
TOPIC_WORDS_PER_QUESTION = 5
# How long the ledger may take to hold every answer's row (settlements are
# written as streams end, cache entries stored in the background).
LEDGER_WAIT_S = 30.0

OPENERS = (
    "How do I",
    "What is",
    "Why does",
    "Explain",
    "Compare",
    "When should I use",
    "Where can I find",
    "Is it safe to mix",
)
# Topic words, more than the questions need, so that two share few.
_TOPIC_TEXT = """
    invoice kernel sourdough glacier vacuum trellis compiler mortgage violin saffron
    turbine lichen ledger carburetor espresso tundra firmware pension harpsichord basil
    router barnacle spreadsheet volcano kimchi parachute thermostat sonnet quasar bamboo
    mitochondria flywheel lasagna monsoon passport tapestry algorithm porcupine yeast lantern
    gearbox archipelago vinaigrette satellite hammock enzyme telescope marathon origami canyon
    dividend solder pretzel avalanche scaffold cathedral radiator mushroom cipher meadow
    typewriter nebula compost gazebo insulin lighthouse paprika transistor walrus zeppelin
    mattress quinoa bicycle fjord hydrant kombucha labyrinth manuscript nutmeg orchard
    pendulum quilt reservoir sextant tamarind umbrella vineyard windmill xylophone yogurt
    acorn blizzard cinnamon dolphin eclipse falcon granite horizon iceberg jasmine
    kayak lagoon magnet nickel oyster pigment quartz rhubarb sapphire tornado
    utensil velvet waffle anchor biscuit cobalt dune emerald fossil geyser
"""
TOPICS = tuple(_TOPIC_TEXT.split())


@dataclass(frozen=True)
class Sizes:
    requests: int
    questions: int


FULL = Sizes(requests=900, questions=180)
QUICK = Sizes(requests=300, questions=60)


# -- the trace (pure, seeded) ---------------------------------------------------------


@dataclass(frozen=True)
class Ask:
    """One request of the trace: which question, how it is asked, and its text."""

    question: int
    kind: AskKind
    text: str


def questions(count: int, rng: random.Random) -> list[str]:
    """`count` distinct questions: an opener and TOPIC_WORDS_PER_QUESTION topic
    words. Few shared words, so no two are close enough to serve each other
    (`closest_other` checks it on the trace)."""
    texts: list[str] = []
    while len(texts) < count:
        opener = OPENERS[len(texts) % len(OPENERS)]
        text = f"{opener} {' '.join(rng.sample(TOPICS, TOPIC_WORDS_PER_QUESTION))}?"
        if text not in texts:
            texts.append(text)
    return texts


def paraphrase(text: str, rng: random.Random) -> str:
    """`text` with one or two small changes: a topic word dropped, the closing
    punctuation changed, the case changed. Each leaves a bag-of-words embedding
    close (case and punctuation do not move it at all), and each changes the
    exact key."""
    changes = set(rng.sample(("drop", "punctuation", "case"), rng.choice((1, 2))))
    body, end = text.rstrip("?"), "?"
    if "drop" in changes:
        words = body.split()
        del words[rng.randrange(len(words) - TOPIC_WORDS_PER_QUESTION, len(words))]
        body = " ".join(words)
    if "punctuation" in changes:
        end = rng.choice(("", ".", " ?", "!"))
    result = body + end
    if "case" in changes:
        result = result.lower() if rng.random() < 0.5 else result.title()
    return result


def trace(sizes: Sizes, seed: int = SEED) -> list[Ask]:
    """Every question asked at least once, the other requests drawn with weight
    1/rank**ZIPF_EXPONENT, all shuffled. A question's first occurrence is asked
    as written; a later one verbatim (VERBATIM_SHARE) or paraphrased."""
    if sizes.requests < sizes.questions:
        raise ValueError("a trace asks every question at least once")
    rng = random.Random(seed)
    texts = questions(sizes.questions, rng)
    weights = [1 / (rank + 1) ** ZIPF_EXPONENT for rank in range(sizes.questions)]
    order = list(range(sizes.questions))
    order += rng.choices(range(sizes.questions), weights, k=sizes.requests - sizes.questions)
    rng.shuffle(order)
    seen: set[int] = set()
    asks: list[Ask] = []
    for question in order:
        if question not in seen:
            seen.add(question)
            asks.append(Ask(question, "first", texts[question]))
        elif rng.random() < VERBATIM_SHARE:
            asks.append(Ask(question, "verbatim", texts[question]))
        else:
            asks.append(Ask(question, "paraphrase", paraphrase(texts[question], rng)))
    return asks


def _sparse_unit(text: str) -> dict[int, float]:
    vector = bag_of_words(text)
    norm = math.sqrt(sum(x * x for x in vector))
    return {i: x / norm for i, x in enumerate(vector) if x}


def _cosine(a: dict[int, float], b: dict[int, float]) -> float:
    return sum(x * b.get(i, 0.0) for i, x in a.items())


@dataclass(frozen=True)
class TraceCheck:
    """How close the trace's texts are, by the fake's embedding."""

    closest_other: float  # the most similar texts of two different questions
    farthest_paraphrase: float  # the least similar paraphrase to its question


def check(asks: Sequence[Ask]) -> TraceCheck:
    """Measure the trace by the embedding the semantic cache will see; raise if two
    different questions are within SIMILARITY, since a semantic hit would then
    serve one question's answer for another and still count as a hit."""
    texts = {(a.question, a.text) for a in asks}
    vectors = [(q, _sparse_unit(t)) for q, t in sorted(texts)]
    closest = 0.0
    for i, (q, v) in enumerate(vectors):
        for other, w in vectors[i + 1 :]:
            if other != q:
                closest = max(closest, _cosine(v, w))
    if closest >= SIMILARITY:
        raise RuntimeError(f"two questions of the trace are {closest:.3f} alike (>= {SIMILARITY})")
    firsts = {a.question: _sparse_unit(a.text) for a in asks if a.kind == "first"}
    farthest = min(
        (_cosine(firsts[a.question], _sparse_unit(a.text)) for a in asks if a.kind != "first"),
        default=1.0,
    )
    return TraceCheck(closest_other=closest, farthest_paraphrase=farthest)


# -- the replay -----------------------------------------------------------------------


@dataclass
class Replayed:
    """One tenant's answers: each ask's latency (ms, by its place in the trace),
    which were hits, and the hits by kind of ask."""

    latency_ms: dict[int, float] = field(default_factory=dict)
    hits: set[int] = field(default_factory=set)
    hits_by_kind: Counter[str] = field(default_factory=Counter)
    asked_by_kind: Counter[str] = field(default_factory=Counter)

    @property
    def requests(self) -> int:
        return len(self.latency_ms)

    @property
    def hits_ms(self) -> list[float]:
        return sorted(ms for i, ms in self.latency_ms.items() if i in self.hits)

    @property
    def misses_ms(self) -> list[float]:
        return sorted(ms for i, ms in self.latency_ms.items() if i not in self.hits)


async def ask(sdk: openai.AsyncOpenAI, text: str, *, temperature: float | None = 0) -> str:
    """One streamed question, read to its end; the serving path the proxy says."""
    options: dict[str, Any] = {} if temperature is None else {"temperature": temperature}
    raw = await sdk.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": text}],
        max_tokens=MAX_TOKENS,
        stream=True,
        **options,
    )
    words: list[str] = []
    async for chunk in raw.parse():
        words.extend(c.delta.content or "" for c in chunk.choices)
    if not "".join(words):
        raise RuntimeError(f"an empty answer to {text!r}")
    return str(raw.headers.get(SERVING_PATH_HEADER, ""))


def interleaved(asks: Sequence[Ask]) -> Iterator[tuple[int, Ask, Mode]]:
    """Each ask for every tenant before the next ask, the tenants' order rotating,
    so that none is always first to meet a busy moment."""
    for i, one in enumerate(asks):
        for j in range(len(MODES)):
            yield i, one, MODES[(i + j) % len(MODES)]


async def replay(sdks: dict[Mode, openai.AsyncOpenAI], asks: Sequence[Ask]) -> dict[Mode, Replayed]:
    """The trace against every tenant, CONCURRENCY requests in flight in all."""
    results: dict[Mode, Replayed] = {mode: Replayed() for mode in MODES}
    work = interleaved(asks)

    async def worker() -> None:
        # One iterator shared by the workers: next() runs between awaits, so
        # each (ask, tenant) is taken exactly once.
        for i, one, mode in work:
            started = time.perf_counter()
            path = await ask(sdks[mode], one.text)
            result = results[mode]
            result.latency_ms[i] = (time.perf_counter() - started) * 1000
            result.asked_by_kind[one.kind] += 1
            if path == "cache":
                if mode == "none":
                    raise RuntimeError("a tenant without a cache policy was served from a cache")
                result.hits.add(i)
                result.hits_by_kind[one.kind] += 1
            elif path != "primary":
                raise RuntimeError(f"{SERVING_PATH_HEADER}: {path!r}")

    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return results


# -- the ledger -----------------------------------------------------------------------


@dataclass(frozen=True)
class Books:
    """One tenant's ledger rows after the warm-up."""

    answers: int  # rows of the chat model: every hit and every settled miss
    hits: int
    saved_tokens: int
    charged_tokens: int  # every row not served by the cache, embeddings included
    embedding_tokens: int


BOOKS = """
SELECT tenant,
       count(*) FILTER (WHERE model = $3) AS answers,
       count(*) FILTER (WHERE serving_path = 'cache') AS hits,
       coalesce(sum(saved_input_tokens + saved_output_tokens)
                FILTER (WHERE serving_path = 'cache'), 0) AS saved_tokens,
       coalesce(sum(input_tokens + output_tokens)
                FILTER (WHERE serving_path IS DISTINCT FROM 'cache'), 0) AS charged_tokens,
       coalesce(sum(input_tokens + output_tokens) FILTER (WHERE model = $4), 0)
           AS embedding_tokens
  FROM usage_ledger
 WHERE tenant = ANY($1::text[]) AND entry_id > $2
 GROUP BY tenant
"""


async def books(
    dsn: str, tenants: dict[Mode, str], after_entry: int, answers: int
) -> dict[Mode, Books]:
    """Each tenant's books once it has `answers` rows of the chat model after
    `after_entry`; raises if that takes longer than LEDGER_WAIT_S."""
    connection = await asyncpg.connect(dsn)
    try:
        deadline = time.monotonic() + LEDGER_WAIT_S
        while True:
            rows = await connection.fetch(
                BOOKS, list(tenants.values()), after_entry, MODEL, EMBEDDING_MODEL
            )
            found = {
                row["tenant"]: Books(
                    answers=int(row["answers"]),
                    hits=int(row["hits"]),
                    saved_tokens=int(row["saved_tokens"]),
                    charged_tokens=int(row["charged_tokens"]),
                    embedding_tokens=int(row["embedding_tokens"]),
                )
                for row in rows
            }
            counts = {mode: found[t].answers if t in found else 0 for mode, t in tenants.items()}
            if all(n >= answers for n in counts.values()):
                return {mode: found[t] for mode, t in tenants.items()}
            if time.monotonic() > deadline:
                raise RuntimeError(f"ledger rows per tenant {counts}, expected {answers} each")
            await asyncio.sleep(0.1)
    finally:
        await connection.close()


async def last_entry(dsn: str) -> int:
    connection = await asyncpg.connect(dsn)
    try:
        return int(await connection.fetchval("SELECT coalesce(max(entry_id), 0) FROM usage_ledger"))
    finally:
        await connection.close()


# -- the run --------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    sizes: Sizes
    trace: TraceCheck
    replayed: dict[Mode, Replayed]
    books: dict[Mode, Books]

    def hit_rate(self, mode: Mode) -> float:
        return 100 * len(self.replayed[mode].hits_ms) / self.replayed[mode].requests

    def baseline_ms(self, mode: Mode) -> list[float]:
        """The baseline's latencies for the asks `mode` missed, sorted. Not all of
        the baseline's: a cache misses mostly first asks, which come early in the
        trace, and the machine's other work is not the same early and late."""
        mine = self.replayed[mode]
        latency = self.replayed["none"].latency_ms
        return sorted(latency[i] for i in mine.latency_ms if i not in mine.hits)

    def added_ms(self, mode: Mode, fraction: float) -> float:
        """A miss's latency percentile in `mode` minus the baseline's on the same asks."""
        mine = self.replayed[mode].misses_ms
        return percentile(mine, fraction) - percentile(self.baseline_ms(mode), fraction)

    def paired_added_ms(self, mode: Mode) -> float:
        """The median, over the asks `mode` missed, of its latency minus the
        baseline's for the same ask: sent moments apart, the two met the same
        machine, so this moves less with other work than a difference of p50s."""
        mine, baseline = self.replayed[mode], self.replayed["none"]
        return statistics.median(
            ms - baseline.latency_ms[i] for i, ms in mine.latency_ms.items() if i not in mine.hits
        )

    def hit_p50_ms(self) -> float:
        hits = sorted(self.replayed["exact"].hits_ms + self.replayed["semantic"].hits_ms)
        return percentile(hits, 0.5)


async def measure(
    dsn: str, base: str, keys: dict[Mode, str], tenants: dict[Mode, str], asks: Sequence[Ask]
) -> tuple[dict[Mode, Replayed], dict[Mode, Books]]:
    sdks = {
        mode: openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=60)
        for mode, key in keys.items()
    }
    try:
        for mode in MODES:
            for i in range(WARMUP):
                await ask(sdks[mode], f"warm-up {i}", temperature=None)
        await books(dsn, tenants, 0, WARMUP)
        floor = await last_entry(dsn)
        replayed = await replay(sdks, asks)
    finally:
        for sdk in sdks.values():
            await sdk.close()
    booked = await books(dsn, tenants, floor, len(asks))
    for mode in MODES:
        if booked[mode].hits != len(replayed[mode].hits_ms):
            raise RuntimeError(
                f"{mode}: {len(replayed[mode].hits_ms)} answers from the cache, "
                f"{booked[mode].hits} cache rows in the ledger"
            )
    return replayed, booked


def run(server_dsn: str, sizes: Sizes) -> Outcome:
    """The whole comparison on a fresh database of `server_dsn`. The trace is
    checked before anything starts, so a trace where a semantic hit could be
    another question's answer fails in a second, not after the replay."""
    asks = trace(sizes)
    checked = check(asks)
    dsn = asyncio.run(fresh_database(server_dsn, "bench_response_cache"))
    tenants: dict[Mode, str] = {mode: f"cache-{mode}" for mode in MODES}
    with (
        proxy_overhead.fake_provider(semantic_embeddings=True) as fake_url,
        proxy_overhead.proxy_server(dsn, fake_url) as base,
    ):
        keys: dict[Mode, str] = {}
        for mode, tenant in tenants.items():
            policy = CACHE_POLICIES[mode]
            extra = {} if policy is None else {"cache": policy}
            keys[mode] = proxy_overhead.tenant_key(base, tenant, **extra)
        replayed, booked = asyncio.run(measure(dsn, base, keys, tenants, asks))
    return Outcome(sizes, checked, replayed, booked)


def section(server_dsn: str, quick: bool, report: Report) -> None:
    """Replay the trace against the three tenants and add the section;
    `server_dsn` is the bench's PostgreSQL server (a fresh database is made)."""
    report.line(
        "== 11. response cache: a trace of repeated questions, no cache vs exact vs semantic"
    )
    sizes = QUICK if quick else FULL
    load = machine_load()
    outcome = run(server_dsn, sizes)
    rows = [
        "| tenant's cache | hits: answers / ledger | hit rate | verbatim repeats served "
        "| paraphrases served | tokens charged | tokens saved | misses: p50 / p99 ms "
        "| the baseline on the same asks: p50 / p99 ms "
        "| a miss minus the baseline, same ask, median ms | hits: p50 ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for mode in MODES:
        row, line = figures(outcome, mode)
        rows.append(row)
        report.line(line)
    lines = summary_lines(outcome)
    report.sections.append("\n".join(describe(outcome, rows, lines, load)))
    for line in lines:
        report.line(line, summary=True)


def figures(o: Outcome, mode: Mode) -> tuple[str, str]:
    """One tenant's table row, and its progress line."""
    r, b = o.replayed[mode], o.books[mode]
    misses, hits = r.misses_ms, r.hits_ms
    served = {
        kind: f"{r.hits_by_kind[kind]} of {r.asked_by_kind[kind]}"
        for kind in ("verbatim", "paraphrase")
    }
    hit_p50 = f"{percentile(hits, 0.5):.1f}" if hits else "-"
    miss_p50, miss_p99 = percentile(misses, 0.5), percentile(misses, 0.99)
    if mode == "none":
        paired = baseline = "-"
    else:
        same = o.baseline_ms(mode)
        baseline = f"{percentile(same, 0.5):.1f} / {percentile(same, 0.99):.1f}"
        paired = f"{o.paired_added_ms(mode):+.1f}"
    row = (
        f"| {mode} | {len(hits)} / {b.hits} | {o.hit_rate(mode):.1f}% "
        f"| {served['verbatim']} | {served['paraphrase']} "
        f"| {b.charged_tokens:,} ({b.embedding_tokens:,} embedding) | {b.saved_tokens:,} "
        f"| {miss_p50:.1f} / {miss_p99:.1f} | {baseline} | {paired} | {hit_p50} |"
    )
    line = (
        f"  {mode:8}: hit rate {o.hit_rate(mode):5.1f}% ({len(hits)} answers, {b.hits} "
        f"ledger rows; verbatim {served['verbatim']}, paraphrases {served['paraphrase']}), "
        f"charged {b.charged_tokens} tokens ({b.embedding_tokens} embedding), saved "
        f"{b.saved_tokens}, miss p50 {miss_p50:.1f} ms p99 {miss_p99:.1f} ms "
        f"(same ask vs baseline {paired} ms), hit p50 {hit_p50} ms"
    )
    return row, line


def summary_lines(o: Outcome) -> list[str]:
    """The three summary lines, in the forms other tools grep for."""
    b = o.books
    return [
        f"response cache hit rate: exact {o.hit_rate('exact'):.1f}%, "
        f"semantic {o.hit_rate('semantic'):.1f}% "
        f"({o.sizes.requests} requests, {o.sizes.questions} distinct questions)",
        f"response cache tokens saved: exact {b['exact'].saved_tokens}, "
        f"semantic {b['semantic'].saved_tokens} (charged: none {b['none'].charged_tokens}, "
        f"exact {b['exact'].charged_tokens}, semantic {b['semantic'].charged_tokens})",
        f"response cache miss added latency: exact p50 {o.added_ms('exact', 0.5):+.1f} ms "
        f"p99 {o.added_ms('exact', 0.99):+.1f} ms, semantic p50 "
        f"{o.added_ms('semantic', 0.5):+.1f} ms p99 {o.added_ms('semantic', 0.99):+.1f} ms "
        f"(hit p50 {o.hit_p50_ms():.1f} ms)",
    ]


def describe(o: Outcome, rows: list[str], lines: list[str], load: str) -> list[str]:
    repeats = o.sizes.requests - o.sizes.questions
    semantic_misses = len(o.replayed["semantic"].misses_ms)
    return [
        "## 11. The response cache: hit rate, tokens saved, and what a miss adds",
        "",
        f"A seeded trace of {o.sizes.requests} requests over {o.sizes.questions} distinct "
        "questions: each question asked once,",
        f"the other {repeats} drawn with weight 1/rank (Zipf, s = {ZIPF_EXPONENT:g}), all "
        "shuffled. A repeat is",
        f"asked verbatim ({VERBATIM_SHARE:.0%}) or paraphrased (a word dropped, its case or "
        "its closing",
        "punctuation changed). The fake provider of the proxy tests answers 16 words, 5 ms",
        "before each streamed word, bills every answer alike, and embeds by bag of words:",
        f"a paraphrase lies at cosine {o.trace.farthest_paraphrase:.2f} or more to its "
        "question, two different questions",
        f"at {o.trace.closest_other:.2f} at most (the semantic tenant serves at "
        f"{SIMILARITY:g}), so every semantic hit",
        "is its own question's answer. llmquota runs in proxy mode on the bench's",
        "PostgreSQL with three fresh tenants: no cache, exact, and semantic (embeddings by",
        f"`{EMBEDDING_MODEL}`). AsyncOpenAI replays the whole trace against each, streamed at",
        f"temperature 0, the tenants taking turns, {CONCURRENCY} requests in flight in all; a",
        "latency is the time to the stream's end. Hits are counted from the answers'",
        "`llmquota-serving-path` header and checked against the ledger's cache rows;",
        "tokens are the ledger's. A cache tenant's misses are compared with the",
        "baseline's answers to the same asks (sent moments apart), not with all of the",
        "baseline's: misses are mostly first asks, which come early in the trace. The",
        "summary's added latency is the difference of those two sets' p50 and p99; the",
        "same-ask column is the median of the differences ask by ask, which moves least",
        f"with the machine's other work. At the start {load}; at the end {machine_load()}.",
        "",
        *rows,
        "",
        *(f"`{line}`\n" for line in lines),
        "The gap between the two hit rates is the paraphrases: exact serves only those",
        "asked before in the same words, semantic serves them all, and pays for it in",
        "embedding tokens charged to the tenant. A miss costs more with a cache than",
        "without: exact adds one lookup statement before admission (and stores the answer",
        "afterwards, in the background), while semantic adds that lookup, then an embedding",
        "call admitted, sent and settled like any request of the tenant, then a second",
        "lookup that scans the context's entries within the SimHash distance and compares",
        "them by cosine in SQL. A hit skips admission and the provider: one statement finds",
        "it and books it. The p99 differences rest on a few slowest requests (the semantic",
        f"tenant missed {semantic_misses} times in all) and move the most from run to run;",
        "against a real provider, whose answers take seconds, a miss's added milliseconds",
        "are small next to what each hit saves.",
    ]
