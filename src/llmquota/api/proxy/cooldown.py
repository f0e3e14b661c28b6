"""Which of a model's deployments to try first, from how each answered lately.

A model listed under several upstreams (deployments) is tried in its routing
rule's rank, the next one taking the request when one answers 429 or 5xx or
not at all (routes.py). Without memory, every request would go to a first
deployment that keeps failing, pay its latency and its error, and only then
reach the next. So each worker remembers, per deployment and model (a
provider's limits are per model: a 429 for gpt-4o says nothing of
gpt-4o-mini on the same upstream), for models with another deployment to
try instead (the caller says which):

- a 429 cools it down at once: the provider said it is over its limit, and
  for how long (`retry-after-ms`, else `retry-after`);
- a 5xx, a broken connection or a timeout counts, and `failures` of them in
  a row cool it down: one may be a blip, several are an outage. Any other
  answer (a success, the client's own 400) resets the count;
- a cooldown lasts the provider's hint, else `seconds`, and never more than
  MAX_DEPLOYMENT_COOLDOWN_SECONDS (an hour) whatever the provider says: a
  provider that names a day still gets its deployment tried within the hour.

A cooled deployment is tried after every deployment of the model that is
not cooled (those in rank, then the cooled ones, the one whose cooldown ends
first leading), so it is skipped while another may serve, and still tried
when none other does. Unlike LiteLLM's router, which this follows for the
decision (its `allowed_fails` and `cooldown_time`, a 429 cooling at once),
a model whose every deployment is cooled is not refused here: refusing a
model the provider keeps refusing is the provider ceilings' cooldown
(PROXY_CEILING_COOLDOWN_SECONDS), which llmquota decides with every other
limit and answers with a retry-after.

A cooled deployment that is tried and answers well is cooled no longer. One
that fails again once its cooldown is over is cooled again at once, without
counting to `failures` anew: only a good answer resets the count. An answer
to an attempt sent before the cooldown began says nothing about the
deployment since, and ends nothing.

The memory is per worker, pure, and bounded: `now` (a monotonic clock, in
seconds) is passed in, and at most MAX_TRACKED pairs are kept (a model name
comes from the client, any name a glob matches), the oldest forgotten first:
a forgotten deployment is only tried in rank again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from llmquota.config import MAX_DEPLOYMENT_COOLDOWN_FAILURES, MAX_DEPLOYMENT_COOLDOWN_SECONDS

# Deployment and model pairs remembered at once, per worker.
MAX_TRACKED = 10_000


@dataclass(slots=True)
class _Health:
    """What one deployment of one model did lately."""

    # Failures (5xx, no answer) since its last good answer.
    failures: int = 0
    # When its cooldown began and ends (None, 0: not cooled since its last good answer).
    cooled_at: float | None = None
    until: float = 0.0


def retry_after_seconds(headers: Mapping[str, str]) -> float | None:
    """The provider's retry hint in seconds (`retry-after-ms` first), if it gave one.

    Only numbers: the HTTP-date form of retry-after is not sent by LLM providers.
    """
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        try:
            value = float(headers.get(name, ""))
        except ValueError:
            continue
        if value > 0:
            return value * scale
    return None


class DeploymentCooldowns:
    """One worker's memory of its deployments' failures and cooldowns."""

    def __init__(self, *, seconds: float, failures: int, max_tracked: int = MAX_TRACKED) -> None:
        if not 0 <= seconds <= MAX_DEPLOYMENT_COOLDOWN_SECONDS:
            raise ValueError(f"seconds must be within 0 and {MAX_DEPLOYMENT_COOLDOWN_SECONDS:g}")
        if not 1 <= failures <= MAX_DEPLOYMENT_COOLDOWN_FAILURES:
            raise ValueError(f"failures must be within 1 and {MAX_DEPLOYMENT_COOLDOWN_FAILURES}")
        if max_tracked < 1:
            raise ValueError("max_tracked must be at least 1")
        # 0: off. Deployments are tried in rank, nothing is remembered.
        self.seconds = seconds
        self.failures = failures
        self.max_tracked = max_tracked
        self._health: dict[tuple[str, str], _Health] = {}

    def cooled(self, upstream: str, model: str, now: float) -> bool:
        """Whether `upstream` is cooled down for `model` at `now`."""
        health = self._health.get((upstream, model))
        return health is not None and now < health.until

    def order(self, ranked: Sequence[str], model: str, now: float) -> list[str]:
        """`ranked` (upstream names, in the routing rule's rank) in the order to try
        them: those not cooled in rank, then the cooled ones, soonest ending first."""
        warm = [name for name in ranked if not self.cooled(name, model, now)]
        cooled = [name for name in ranked if self.cooled(name, model, now)]
        cooled.sort(key=lambda name: self._health[(name, model)].until)  # stable: rank on ties
        return warm + cooled

    def refused(
        self, upstream: str, model: str, now: float, retry_after: float | None = None
    ) -> bool:
        """A 429: cooled at once, for `retry_after` seconds (the provider's hint) or
        the setting's. True if a cooldown began (it was not cooled)."""
        health = self._track(upstream, model)
        if health is None:
            return False
        return self._cool(health, now, retry_after)

    def failed(
        self, upstream: str, model: str, now: float, retry_after: float | None = None
    ) -> bool:
        """A 5xx, or no answer: counted, and cooled at the `failures`-th in a row.
        True if a cooldown began."""
        health = self._track(upstream, model)
        if health is None:
            return False
        health.failures += 1
        if health.failures < self.failures:
            return False
        return self._cool(health, now, retry_after)

    def answered(self, upstream: str, model: str, sent_at: float) -> None:
        """Any other answer to an attempt sent at `sent_at`: the count starts
        again, and a cooldown that began before it was sent ends."""
        key = (upstream, model)
        health = self._health.get(key)
        if health is None:
            return
        health.failures = 0
        if health.cooled_at is None or sent_at >= health.cooled_at:
            del self._health[key]  # nothing left to remember

    def _track(self, upstream: str, model: str) -> _Health | None:
        """The pair's record, made if new (forgetting the oldest past the bound);
        None when cooldowns are off."""
        if self.seconds <= 0:
            return None
        key = (upstream, model)
        health = self._health.get(key)
        if health is None:
            while len(self._health) >= self.max_tracked:
                del self._health[next(iter(self._health))]
            health = self._health[key] = _Health()
        return health

    def _cool(self, health: _Health, now: float, retry_after: float | None) -> bool:
        """Cool until the later of its current end and `now` plus the hint or the setting."""
        seconds = min(
            retry_after if retry_after is not None else self.seconds,
            MAX_DEPLOYMENT_COOLDOWN_SECONDS,
        )
        began = now >= health.until
        if began:
            health.cooled_at = now
        health.until = max(health.until, now + seconds)
        return began
