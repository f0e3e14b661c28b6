"""The configured providers, which model goes where, and the one pooled HTTP client.

Upstreams come from the settings (the simple per-format variables and
LLMQUOTA_UPSTREAMS_FILE, see llmquota.config.upstreams); a request goes to
the upstream of its endpoint's wire format that names its model exactly,
else to the first whose glob matches it, else nowhere (a 404, nothing
reserved). Each upstream may have its own timeouts on the shared pool.

The provider key lives here and goes only into the upstream request's
headers: nothing the proxy answers, and nothing it logs, contains it. Every
byte relayed from an upstream (error bodies, whole answers, each stream
event, the headers passed back) goes through `scrub`, which replaces the key
in any spelling a provider plausibly echoes it in (domain.scrubbing), and an
upstream authentication failure is answered as a gateway error of our own
(the provider's message names the key it was given).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import httpx
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from llmquota.api.proxy.cooldown import DeploymentCooldowns
from llmquota.api.proxy.metrics import ProxyMetrics
from llmquota.api.proxy.pool import ConnectionShares
from llmquota.api.proxy.settles import SettlesInFlight
from llmquota.api.proxy.sharded_pool import ShardedTransport
from llmquota.api.proxy.wire import Endpoint, Kind
from llmquota.config import ENV_PREFIX, Settings, UpstreamConfig, route
from llmquota.config.upstreams import deployments, routing_rule
from llmquota.domain.records import Deployment
from llmquota.domain.scrubbing import SecretScrubber
from llmquota.domain.vocabulary import DeploymentRule

ANTHROPIC_VERSION = "2023-06-01"
# Client headers a provider needs to read the request as it was meant.
_FORWARDED = {"anthropic": ("anthropic-version", "anthropic-beta"), "openai": ()}
# Provider response headers worth passing on: request ids, for support tickets.
PASSED_BACK = ("x-request-id", "request-id", "openai-processing-ms")
# An upstream 429's headers, passed through with it.
UPSTREAM_LIMIT_PREFIXES = ("x-ratelimit-", "anthropic-ratelimit-", "retry-after")
# The least time left of a request's deadline in which another deployment is
# tried: less would reach the provider only to be cut off, while the provider
# may still do (and bill) the work nobody reads.
MIN_ATTEMPT_SECONDS = 0.25
# Each endpoint's path under its upstream's base URL (OpenAI's includes /v1).
PATHS: dict[Endpoint, str] = {
    "chat": "/chat/completions",
    "completions": "/completions",
    "embeddings": "/embeddings",
    "messages": "/v1/messages",
    "count_tokens": "/v1/messages/count_tokens",
}


@dataclass(frozen=True, slots=True)
class Upstream:
    """One provider: where it is, the key llmquota calls it with, its timeouts."""

    kind: Kind
    base_url: str
    api_key: SecretStr
    name: str = ""
    # None: the pool's timeouts (LLMQUOTA_PROXY_*_TIMEOUT_SECONDS).
    timeout: httpx.Timeout | None = None
    _scrubber: SecretScrubber = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_scrubber", SecretScrubber(self.api_key.get_secret_value()))

    def url(self, endpoint: Endpoint) -> str:
        return self.base_url.rstrip("/") + PATHS[endpoint]

    def headers(self, client_headers: Mapping[str, str]) -> dict[str, str]:
        """The upstream request's headers: our key, the provider's own version headers."""
        headers = {"content-type": "application/json", "accept-encoding": "identity"}
        key = self.api_key.get_secret_value()
        if self.kind == "openai":
            headers["authorization"] = f"Bearer {key}"
        else:
            headers["x-api-key"] = key
            headers["anthropic-version"] = ANTHROPIC_VERSION
        for name in _FORWARDED[self.kind]:
            if name in client_headers:
                headers[name] = client_headers[name]
        return headers

    def scrub(self, text: bytes) -> bytes:
        """`text` without the provider key in it, in any spelling."""
        return self._scrubber.scrub(text)

    def scrub_headers(self, headers: Mapping[str, str]) -> dict[str, str]:
        """Headers passed back from the upstream, each value scrubbed."""
        return {
            name: self._scrubber.scrub(value.encode("latin-1", "replace")).decode("latin-1")
            for name, value in headers.items()
        }


def missing_upstream(kind: Kind) -> str:
    """What to set for an endpoint whose upstream is not configured."""
    name = kind.upper()
    return (
        f"the {kind} proxy is not configured: set {ENV_PREFIX}{name}_BASE_URL and "
        f"{ENV_PREFIX}{name}_API_KEY, or list a {kind} upstream in {ENV_PREFIX}UPSTREAMS_FILE"
    )


def unserved_model(kind: Kind, model: str) -> str:
    """Why a model no upstream serves is refused (a 404, as the provider says it)."""
    return (
        f"the model {model!r} is not served here: no {kind} upstream of this llmquota "
        "lists it (their 'models' in the upstreams file)"
    )


def _upstream(config: UpstreamConfig, settings: Settings) -> Upstream:
    """The proxy's view of a configured upstream, its timeouts completed from the settings."""
    timeout = None
    if config.connect_timeout_seconds is not None or config.read_timeout_seconds is not None:
        timeout = httpx.Timeout(
            config.read_timeout_seconds or settings.proxy_read_timeout_seconds,
            connect=config.connect_timeout_seconds or settings.proxy_connect_timeout_seconds,
        )
    return Upstream(config.format, config.base_url, config.api_key, config.name, timeout)


@dataclass(frozen=True, slots=True)
class Chain:
    """The deployments one request may try, in order, and the deadline they share.

    The deadline is as long as the most patient of the model's deployments
    would be waited for alone (Proxy.patience_seconds): a model with one
    deployment is bounded as it always was, and a request handed from one to
    the next never takes several times that. Each attempt waits only for
    what is left; the client's SDK, whose own timeout is set against one
    provider call, is answered in time. Another attempt starts only with
    MIN_ATTEMPT_SECONDS left.
    """

    ranked: tuple[Upstream, ...]  # the routing rule's rank
    order: tuple[Upstream, ...]  # the order tried
    deadline: float  # the event loop's time
    tried: set[str] = field(default_factory=set)  # the names of those tried so far

    @property
    def cools(self) -> bool:
        """Whether a deployment's failures cool it down: the model has another to try."""
        return len(self.ranked) > 1

    def later(self, upstream: Upstream) -> bool:
        """Whether a deployment other than `upstream` is still to be tried."""
        return any(u is not upstream and u.name not in self.tried for u in self.order)

    def next_untried(self) -> Upstream | None:
        """The first deployment in the order tried that has not been."""
        return next((u for u in self.order if u.name not in self.tried), None)

    def time_for_another(self) -> bool:
        """Whether another attempt may start: enough of the deadline is left."""
        return self.deadline - asyncio.get_running_loop().time() >= MIN_ATTEMPT_SECONDS


class Proxy:
    """The upstreams of one worker, a pooled client for each with its tenants'
    shares (pool.py), and the streams it is still settling."""

    def __init__(self, settings: Settings, registry: CollectorRegistry | None = None) -> None:
        self.settings = settings
        self.metrics = ProxyMetrics(registry or CollectorRegistry())
        self.configs = settings.upstreams()
        self.routing = settings.routing()
        self.upstreams = {c.name: _upstream(c, settings) for c in self.configs}
        self.clients = {name: _pooled_client(settings) for name in self.upstreams}
        self.shares = {
            name: ConnectionShares(
                name,
                capacity=settings.proxy_max_connections,
                tenant_share=settings.proxy_tenant_connection_share,
                wait_seconds=settings.proxy_pool_wait_ms / 1000.0,
                max_drains=settings.proxy_tenant_max_drains,
            )
            for name in self.upstreams
        }
        self.pumps: set[asyncio.Task[None]] = set()
        # Whole answers' settlements, sent after the answer (settles.py).
        self.settles = SettlesInFlight()
        # Which deployments of a model answered 429 or failed lately (cooldown.py).
        self.cooldowns = DeploymentCooldowns(
            seconds=settings.proxy_deployment_cooldown_seconds,
            failures=settings.proxy_deployment_cooldown_failures,
        )
        for name in self.upstreams:  # each reads 0 before its first cooldown
            self.metrics.deployment_cooldowns.labels(name)

    def client(self, upstream: Upstream) -> httpx.AsyncClient:
        """The pooled client of `upstream` (one pool per upstream)."""
        return self.clients[upstream.name]

    def configured(self, kind: Kind) -> bool:
        """Whether any upstream speaks `kind` (else its endpoints answer 404)."""
        return any(c.format == kind for c in self.configs)

    def route(self, kind: Kind, model: str) -> Upstream | None:
        """The upstream serving `model` in format `kind`, the first its routing rule
        ranks; None if none does."""
        config = route(self.configs, kind, model, self.routing)
        return None if config is None else self.upstreams[config.name]

    def deployments(self, kind: Kind, model: str) -> list[Upstream]:
        """Every upstream serving `model` in format `kind`, in its routing rule's rank:
        the first is `route`'s, the others are tried when it answers 429 or 5xx."""
        ranked = deployments(self.configs, kind, model, self.routing)
        return [self.upstreams[c.name] for c in ranked]

    def chain(self, kind: Kind, model: str, first: str | None = None) -> Chain:
        """The deployments a request for `model` tries: `first` (the one its
        admission chose), then those not cooled down in rank, then the cooled ones
        (cooldown.py), all within one deadline."""
        ranked = self.deployments(kind, model)
        order = self.cooldowns.order([u.name for u in ranked], model, time.monotonic())
        if first in order:
            order.remove(first)
            order.insert(0, first)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(map(self.patience_seconds, ranked), default=0.0)
        return Chain(tuple(ranked), tuple(self.upstreams[name] for name in order), deadline)

    def admission_deployments(
        self, kind: Kind, models: list[str], skip: frozenset[str] = frozenset()
    ) -> tuple[Deployment, ...]:
        """The deployments of each of `models` as admission tries them (lq_admit
        chooses among them in its statement, a ceiling scoped to one counting only
        there): the order `chain` tries, less `skip` (those already tried), with
        the model's routing rule; `cheapest` is that order already."""
        now = time.monotonic()
        chosen: list[Deployment] = []
        for model in dict.fromkeys(models):
            least = routing_rule(model, self.routing) == "least_utilized"
            rule: DeploymentRule = "least_utilized" if least else "order"
            names = [u.name for u in self.deployments(kind, model)]
            for name in self.cooldowns.order(names, model, now):
                if name not in skip:
                    chosen.append(Deployment(model, name, rule))
        return tuple(chosen)

    def patience_seconds(self, upstream: Upstream) -> float:
        """The longest `upstream` is waited for alone: its connect timeout plus its
        read timeout (its own from the upstreams file, else the PROXY_* settings)."""
        timeout = upstream.timeout or httpx.Timeout(None)
        connect = timeout.connect or self.settings.proxy_connect_timeout_seconds
        return connect + (timeout.read or self.settings.proxy_read_timeout_seconds)

    async def close(self) -> None:
        """Let running streams finish (up to the drain bound), then cancel them; wait
        for every settlement still on its way; close."""
        if self.pumps:
            _done, pending = await asyncio.wait(
                set(self.pumps), timeout=self.settings.proxy_drain_seconds
            )
            for task in pending:
                task.cancel()
            for task in pending:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.settles.close()
        for client in self.clients.values():
            await client.aclose()


def _pooled_client(settings: Settings) -> httpx.AsyncClient:
    """One upstream's client: its pools together as large as the slots its shares
    count, in pools small enough to walk cheaply (sharded_pool.py)."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(
            settings.proxy_read_timeout_seconds, connect=settings.proxy_connect_timeout_seconds
        ),
        transport=ShardedTransport(settings.proxy_max_connections),
        trust_env=False,
        follow_redirects=False,
    )
