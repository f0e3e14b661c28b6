"""What a worker reserves for a request's output: its policy and the learned estimates.

Admission never reads the histograms from the database: each worker keeps a
copy, refreshed in the background every `estimate_refresh_seconds` (only
the histograms that changed since the last read, plus a full reload every
`FULL_RELOAD_EVERY` refreshes), and reads the policy from the policy cache
(policy_cache.py, refreshed the same way). A request is then prepared with
the output tokens to reserve (domain/output_estimates.py decides), and the
admission statement reserves input + that instead of input + max_tokens.
Each fallback gets its own, from its own histogram under the same policy, so
that a degraded admission reserves what the model it admits is expected to
use (sql/admission.sql costs each candidate by its own figures): an explicit
fallback, and a route's or plan's default list, which is then passed as
explicit fallbacks with the requested model's input count (as the statement
would count them).

Whatever this worker does not know reserves max_tokens: a tenant or route
not in the policy cache yet, a strategy a newer release stored, a key with
fewer than `min_samples` (decayed) samples, a histogram not loaded yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from datetime import datetime, timedelta

from llmquota.admission.policy_cache import PolicyCache
from llmquota.config import Settings
from llmquota.domain.errors import StoreUnavailable
from llmquota.domain.output_estimates import (
    FixedEstimate,
    LearnedEstimate,
    MaxTokensEstimate,
    OutputHistogram,
    OutputReserve,
    output_reserve,
)
from llmquota.domain.records import AdmitRequest, FallbackCandidate
from llmquota.store.store import Store

log = logging.getLogger(__name__)

HistogramKey = tuple[str, str | None, str]
EstimatePolicy = MaxTokensEstimate | LearnedEstimate | FixedEstimate

# A histogram row is stamped with the database clock when its settlement
# runs, and becomes visible when that transaction commits, a little later:
# each refresh asks again from this far before the last read's clock, so a
# commit slower than this is only picked up by the next full reload.
VISIBILITY_MARGIN = timedelta(seconds=30)
FULL_RELOAD_EVERY = 60


class OutputEstimator:
    """One worker's learned output histograms, and the reservation they give."""

    def __init__(self, store: Store, policies: PolicyCache, settings: Settings) -> None:
        self._store = store
        self._policies = policies
        self.refresh_seconds = settings.estimate_refresh_seconds
        self.max_keys = settings.estimate_cache_max_keys
        self._deadline_seconds = settings.statement_timeout_ms / 1000.0
        self._histograms: dict[HistogramKey, OutputHistogram] = {}
        self._read_at: datetime | None = None
        self._loaded_at: float | None = None
        self._refreshes = 0
        self._refreshing: asyncio.Task[None] | None = None

    def histogram(self, tenant: str, route: str | None, model: str) -> OutputHistogram | None:
        """The cached histogram of a key, if any."""
        return self._histograms.get((tenant, route, model))

    def policy(self, tenant: str, route: str | None) -> EstimatePolicy | None:
        """The route's output_estimate, else the tenant's (its plan's); None when unknown."""
        for layer in self._policies.own_layers(tenant, route):
            if layer is not None and layer.policy.output_estimate is not None:
                return layer.policy.output_estimate
        return None

    def apply(self, request: AdmitRequest) -> AdmitRequest:
        """The request with the output tokens to reserve; starts a refresh when due.

        Each explicit fallback gets its own reserve, from its own histogram under
        the same policy: the statement reserves a degraded admission's output by
        the model it admits, not by the one that was refused.
        """
        self._refresh_when_due()
        policy = self.policy(request.tenant, request.route)
        if policy is None and request.max_tokens_given and _reserves_max_tokens(request):
            return request  # output_reserve would answer max_tokens, as the request says
        reserve = self._reserve(policy, request, request.model)
        reserved = request.max_tokens if request.output_reserve is None else request.output_reserve
        fallbacks = request.fallbacks or self._defaults(request)
        if fallbacks:
            fallbacks = tuple(self._fallback(policy, request, c) for c in fallbacks)
        if (
            reserve.strategy == request.output_strategy
            and reserve.tokens == reserved
            and fallbacks == request.fallbacks
        ):
            # Nothing to change (output_reserve None means max_tokens): no copy.
            return request
        return request._replace(
            output_reserve=reserve.tokens, output_strategy=reserve.strategy, fallbacks=fallbacks
        )

    def _reserve(
        self, policy: EstimatePolicy | None, request: AdmitRequest, model: str
    ) -> OutputReserve:
        """What `request` reserves for output when `model` is admitted for it."""
        return output_reserve(
            policy,
            self.histogram(request.tenant, request.route, model),
            request.max_tokens,
            max_tokens_given=request.max_tokens_given,
        )

    def _defaults(self, request: AdmitRequest) -> tuple[FallbackCandidate, ...]:
        """The route's default fallback list, else the tenant's (its plan's), as the
        statement reads it, for a request that may degrade and names none: each
        with the requested model's input count, to be reserved at its own estimate."""
        if request.degrade is False:
            return ()
        for layer in self._policies.own_layers(request.tenant, request.route):
            if layer is not None and layer.fallback_models:
                models = layer.fallback_models
                return tuple(
                    FallbackCandidate(m, request.input_tokens) for m in models if m != request.model
                )
        return ()

    def _fallback(
        self, policy: EstimatePolicy | None, request: AdmitRequest, candidate: FallbackCandidate
    ) -> FallbackCandidate:
        """An explicit fallback with its own output reserve (the same one: no copy)."""
        reserve = self._reserve(policy, request, candidate.model)
        reserved = (
            request.max_tokens if candidate.output_reserve is None else candidate.output_reserve
        )
        if reserve.strategy == candidate.output_strategy and reserve.tokens == reserved:
            return candidate
        return candidate._replace(output_reserve=reserve.tokens, output_strategy=reserve.strategy)

    def _refresh_when_due(self) -> None:
        now = time.monotonic()
        if self._loaded_at is not None and now - self._loaded_at < self.refresh_seconds:
            return
        if self._refreshing is None or self._refreshing.done():
            self._loaded_at = now  # one attempt per period, answered or not
            self._refreshing = asyncio.ensure_future(self._refresh_quietly())

    async def _refresh_quietly(self) -> None:
        """A background refresh: whatever goes wrong, decisions carry on with the last copy."""
        try:
            await self.refresh()
        except StoreUnavailable:
            log.info("refreshing the output estimates failed: the store did not answer")
        except Exception:
            log.warning("refreshing the output estimates failed", exc_info=True)

    async def refresh(self) -> None:
        """Read the histograms that changed since the last read (all, now and then)."""
        full = self._read_at is None or self._refreshes % FULL_RELOAD_EVERY == 0
        since = None if full or self._read_at is None else self._read_at - VISIBILITY_MARGIN
        read = await self._store.estimates.histograms(
            changed_after=since, limit=self.max_keys, deadline_seconds=self._deadline_seconds
        )
        fresh = {stored.key: stored.histogram for stored in read.histograms}
        if full:
            self._histograms = fresh
        else:
            self._histograms.update(fresh)
            while len(self._histograms) > self.max_keys:
                self._histograms.pop(next(iter(self._histograms)))
        if full and len(read.histograms) >= self.max_keys:
            log.warning(
                "output estimate cache holds %d histograms (estimate_cache_max_keys); "
                "the rest reserve max_tokens",
                len(self._histograms),
            )
        self._read_at = read.read_at
        self._loaded_at = time.monotonic()
        self._refreshes += 1

    async def close(self) -> None:
        """Stop a refresh in flight (the pool is about to close)."""
        if self._refreshing is not None and not self._refreshing.done():
            self._refreshing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refreshing

    def __len__(self) -> int:
        return len(self._histograms)


def _reserves_max_tokens(request: AdmitRequest) -> bool:
    """Whether the request, and each of its explicit fallbacks, reserves max_tokens
    as it stands (as every model does without a policy)."""
    if request.output_reserve is not None or request.output_strategy != "max_tokens":
        return False
    return not request.fallbacks or all(
        c.output_reserve is None and c.output_strategy == "max_tokens" for c in request.fallbacks
    )
