"""Prometheus series of proxy mode, on the worker's one registry.

Kept apart from llmquota.metrics (the limiter's series) because only the
proxy adapter observes them, and registered on the same registry so that
/metrics shows both. A provider's 429 is a refusal, counted apart from its
errors: a provider enforcing its limits and a provider failing must not look
alike, as a policy denial and a store error do not. Transport failures are
errors too, with status "timeout" (no answer in time), "unreachable" (no
connection), "broken" (a stream that broke off) or "stream_error" (an error
event inside a stream).
"""

from __future__ import annotations

import time

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from llmquota.api.proxy.wire import Endpoint, Kind
from llmquota.domain.vocabulary import SERVING_PATHS, ServingPath

UPSTREAM_BUCKETS_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TOKENS_PER_SECOND_BUCKETS = (1, 5, 10, 25, 50, 100, 200, 400, 800, 1600, 3200)


class ProxyMetrics:
    """Upstream latency, time to first token, output speed, provider errors, serving
    paths, deployment cooldowns, drains."""

    def __init__(self, registry: CollectorRegistry) -> None:
        by_call = ["provider", "endpoint"]
        self.upstream_seconds = Histogram(
            "llmquota_proxy_upstream_seconds",
            "Time from sending a request upstream to the provider's response head",
            by_call,
            buckets=UPSTREAM_BUCKETS_SECONDS,
            registry=registry,
        )
        self.time_to_first_token = Histogram(
            "llmquota_proxy_time_to_first_token_seconds",
            "Streams: time from sending the request to the first output from the provider",
            by_call,
            buckets=UPSTREAM_BUCKETS_SECONDS,
            registry=registry,
        )
        self.output_tokens_per_second = Histogram(
            "llmquota_proxy_output_tokens_per_second",
            "Streams: the provider's reported output tokens over the time from the "
            "first output to the end of the stream",
            by_call,
            buckets=TOKENS_PER_SECOND_BUCKETS,
            registry=registry,
        )
        self.provider_errors = Counter(
            "llmquota_proxy_provider_errors",
            "Provider calls that failed, by the provider's status (429 excluded: a refusal), "
            "or timeout, unreachable, broken, stream_error",
            ["provider", "status"],
            registry=registry,
        )
        self.provider_refusals = Counter(
            "llmquota_proxy_provider_refusals",
            "Provider answers of 429, passed through to the client with their headers",
            ["provider"],
            registry=registry,
        )
        self._register_serving(registry)
        self.drains_in_progress = Gauge(
            "llmquota_proxy_drains_in_progress",
            "Streams whose client hung up, still read to the provider's final usage",
            registry=registry,
        )

    def _register_serving(self, registry: CollectorRegistry) -> None:
        """How requests were served, and which deployments were passed over."""
        self.serving_paths = Counter(
            "llmquota_serving_path",
            "Proxied requests by how they were served: primary, fallback_model (degraded), "
            "queued (after waiting for room), second_deployment (the first answered "
            "429 or 5xx, just now or lately), rejected (refused by a limit)",
            ["path"],
            registry=registry,
        )
        self.serving_seconds = Histogram(
            "llmquota_serving_path_seconds",
            "Proxied requests: time from arrival to the answer's head, by serving path",
            ["path"],
            buckets=UPSTREAM_BUCKETS_SECONDS,
            registry=registry,
        )
        for path in SERVING_PATHS:  # every path reads 0 before its first request
            self.serving_paths.labels(path)
            self.serving_seconds.labels(path)
        self.deployment_cooldowns = Counter(
            "llmquota_deployment_cooldowns",
            "Cooldowns begun of a deployment of a model listed under several upstreams "
            "(a 429, or PROXY_DEPLOYMENT_COOLDOWN_FAILURES failures in a row): tried after "
            "the model's other deployments meanwhile",
            ["upstream"],
            registry=registry,
        )

    def served(self, path: ServingPath, started: float) -> None:
        """One proxied request answered by `path`, `started` at time.perf_counter()."""
        self.serving_paths.labels(path).inc()
        self.serving_seconds.labels(path).observe(time.perf_counter() - started)

    def cooled(self, upstream: str) -> None:
        """A cooldown of one of `upstream`'s deployments began (api/proxy/cooldown.py)."""
        self.deployment_cooldowns.labels(upstream).inc()

    def call(self, provider: Kind, endpoint: Endpoint) -> CallMetrics:
        """The observations of one upstream call, timed from now."""
        return CallMetrics(self, provider, endpoint)


class CallMetrics:
    """One upstream call: started when created, observed as its events happen."""

    def __init__(self, metrics: ProxyMetrics, provider: Kind, endpoint: Endpoint) -> None:
        self.metrics = metrics
        self.provider = provider
        self.endpoint = endpoint
        self.sent_at = time.perf_counter()
        self.first_output_at: float | None = None
        self.draining = False

    def answered(self, status: int) -> None:
        """The response head arrived: its latency, and its status if not a success."""
        self.metrics.upstream_seconds.labels(self.provider, self.endpoint).observe(
            time.perf_counter() - self.sent_at
        )
        if status == 429:
            self.metrics.provider_refusals.labels(self.provider).inc()
        elif status >= 400:
            self.metrics.provider_errors.labels(self.provider, str(status)).inc()

    def failed(self, exc: BaseException, *, mid_stream: bool = False) -> None:
        """No answer (or no end to a stream): counted by what went wrong."""
        if isinstance(exc, httpx.TimeoutException | TimeoutError):  # ours: the deadline
            status = "timeout"
        elif mid_stream:
            status = "broken"
        else:
            status = "unreachable"
        self.error(status)

    def error(self, status: str) -> None:
        """One provider error, by its status."""
        self.metrics.provider_errors.labels(self.provider, status).inc()

    def output(self) -> None:
        """The provider produced output; the first time, its time to first token."""
        if self.first_output_at is None:
            self.first_output_at = time.perf_counter()
            self.metrics.time_to_first_token.labels(self.provider, self.endpoint).observe(
                self.first_output_at - self.sent_at
            )

    def stream_ended(self, output_tokens: int | None) -> None:
        """A stream ran to its end: its output speed, if the provider reported usage."""
        if self.first_output_at is None or not output_tokens:
            return
        seconds = time.perf_counter() - self.first_output_at
        if seconds > 0:
            self.metrics.output_tokens_per_second.labels(self.provider, self.endpoint).observe(
                output_tokens / seconds
            )

    def drain_started(self) -> None:
        if not self.draining:
            self.draining = True
            self.metrics.drains_in_progress.inc()

    def drain_ended(self) -> None:
        if self.draining:
            self.draining = False
            self.metrics.drains_in_progress.dec()
