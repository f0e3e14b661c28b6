"""A server worker's heap once it has started: frozen, and collected less often.

Measured on a worker under load (BENCHMARKS.md, "the garbage collector"),
CPython's cyclic garbage collector took about 43 us of the ~220 us of CPU
each admit request cost: every collection of an older generation walks
every object the worker holds (modules, the app and its routes, pydantic's
validators, the policy snapshot: some 200,000 objects), and the default
young-generation threshold (700 allocations) starts a collection every few
requests. What exists once the worker has started lives as long as the
worker, so `gc.freeze()` takes it out of the collector's sight for good; a
request allocates a few hundred short-lived objects that reference counting
frees, so collecting the young generation every 10,000 allocations instead
of 700 keeps a little cyclic garbage a little longer and spends about a
microsecond per request on collection instead of tens.

Only `llmquota serve`'s workers do this (llmquota.api.app.create_app_from_env):
a process that builds many apps, as the tests do, would keep what it froze
of each.
"""

from __future__ import annotations

import gc

YOUNG_COLLECTION_ALLOCATIONS = 10_000
"""Net allocations of container objects between two young-generation collections."""


def settle_after_startup() -> None:
    """Collect what start-up left behind, freeze the rest, and collect young objects less often."""
    gc.collect()
    gc.freeze()
    _young, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_COLLECTION_ALLOCATIONS, middle, old)
