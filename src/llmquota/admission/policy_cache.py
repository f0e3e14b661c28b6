"""The policies a worker last loaded, kept for when the store cannot answer.

A worker refreshes its copy of every layer's policy every `refresh_seconds`
while the store answers, and keeps using the last copy while it does not,
for at most `max_stale_seconds`; past that the copy is not trusted and every
layer counts as `closed`. The copy has a version, (max policy_version, layer
count), so a refresh that finds nothing changed transfers one row.

With it, every refresh also takes the budgets as they are then (provider
ceilings, blocking quotas' remaining, prepaid balances, prices: see
domain/local_budget.py), which move with every admission and so have no
version: `local` decisions use a fraction of what they had left.

While the store answers, the copy is also what a request's policy fields
that are not decided in SQL are read from, so that reading them costs no
round trip: the output estimate's strategy (estimates.py) and the response
cache policy the proxy looks answers up by (`cache_policy`).
"""

from __future__ import annotations

from collections.abc import Sequence

from llmquota.domain.ladder import LadderStep
from llmquota.domain.local_budget import OutageBudgets
from llmquota.domain.records import CachedLayer
from llmquota.domain.response_cache import CachePolicy
from llmquota.domain.vocabulary import Scope

LayerKey = tuple[Scope, str | None, str | None]


class PolicyCache:
    """One worker's copy of the policies, with a version and an age."""

    def __init__(self, refresh_seconds: float, max_stale_seconds: float) -> None:
        self.refresh_seconds = refresh_seconds
        self.max_stale_seconds = max_stale_seconds
        self.version: tuple[int, int] | None = None
        self.complete = True
        self._loaded_at: float | None = None
        self._layers: dict[LayerKey, CachedLayer] = {}
        self.budgets = OutageBudgets()
        # The suspended tenants, loaded with every refresh: none of their
        # admissions is decided, whatever key (or library caller) asks.
        self.suspended: frozenset[str] = frozenset()
        # Whether some layer may be decided from slices (or the copy is not
        # whole, so it cannot tell): a reservation id not found may then be
        # one a worker admitted and has not journaled yet.
        self.any_allotted = False

    def replace(self, version: tuple[int, int], layers: Sequence[CachedLayer], now: float) -> None:
        """Take a fresh snapshot (complete when it holds every layer the version counts)."""
        self._layers = {(layer.scope, layer.tenant, layer.route): layer for layer in layers}
        self.version = version
        self.complete = len(layers) >= version[1]
        self.any_allotted = not self.complete or any(
            layer.policy.admission == "allotted" for layer in layers
        )
        self._loaded_at = now

    def replace_budgets(self, budgets: OutageBudgets) -> None:
        """Take the budgets as the store has them now (usable as long as the policies)."""
        self.budgets = budgets

    def scoped_to_deployment(self, model: str) -> bool:
        """Whether a provider ceiling of `model` bounds only one of its deployments
        (its `upstream`), as of the last refresh: a request handed from one
        deployment to another then needs a decision of its own."""
        return self.budgets.scoped_to_deployment(model)

    def ladder_of(self, ceiling: str) -> tuple[LadderStep, ...]:
        """A ceiling's ladder when a step of it queues, as of the last refresh."""
        return self.budgets.ladder_of(ceiling)

    def confirm(self, now: float) -> None:
        """The store says nothing changed: the copy is fresh again."""
        self._loaded_at = now

    def due(self, now: float) -> bool:
        """Whether it is time to ask the store for changes."""
        return self._loaded_at is None or now - self._loaded_at >= self.refresh_seconds

    def usable(self, now: float) -> bool:
        """Whether the copy is recent enough to decide by during an outage."""
        return self._loaded_at is not None and now - self._loaded_at <= self.max_stale_seconds

    def layers_for(self, tenant: str, route: str | None) -> list[CachedLayer] | None:
        """The layers a request of `tenant` passes; None when the tenant is not cached."""
        tenant_layer = self._layers.get(("tenant", tenant, None))
        if tenant_layer is None:
            return None
        layers = [layer for layer in (self._layers.get(("global", None, None)),) if layer]
        layers.append(tenant_layer)
        if route is not None:
            route_layer = self._layers.get(("route", tenant, route))
            if route_layer is not None:
                layers.append(route_layer)
        return layers

    def own_layers(self, tenant: str, route: str | None) -> tuple[CachedLayer | None, ...]:
        """The route's layer then the tenant's, as layers_for finds them (a missing
        route layer is None); () when the tenant is not cached. No list is built:
        admission reads this for every request."""
        tenant_layer = self._layers.get(("tenant", tenant, None))
        if tenant_layer is None:
            return ()
        if route is None:
            return (tenant_layer,)
        return (self._layers.get(("route", tenant, route)), tenant_layer)

    def cache_policy(self, tenant: str, route: str | None) -> CachePolicy | None:
        """The response cache policy of a request: the route layer's own if it has
        one, else the tenant layer's (its own, else its plan's); None when neither
        sets one or the tenant is not cached (caching nothing is always safe).
        Read from this copy, so the proxy asks no question of the store for it."""
        for layer in self.own_layers(tenant, route):
            if layer is not None and layer.cache is not None:
                return layer.cache
        return None

    def __len__(self) -> int:
        return len(self._layers)
