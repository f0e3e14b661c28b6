"""A process's heap once it has started: frozen, and collected less often.

Measured on a server worker under load (BENCHMARKS.md, "the garbage
collector"), CPython's cyclic garbage collector took about 43 us of the
~220 us of CPU each admit request cost: every collection of an older
generation walks every object the process holds (modules, the app and its
routes, pydantic's validators, the policy snapshot: some 200,000 objects),
and the default young-generation threshold (700 allocations) starts a
collection every few requests. The full collections are also the library's
tail: under an open loop of 5,000 admissions a second, one came every few
seconds and stopped the event loop, and every decision waiting on it, for
60 to 120 ms (BENCHMARKS.md, "Issue 25, fifth part").

What exists once a process has started lives as long as the process, so
`gc.freeze()` takes it out of the collector's sight for good; a request
allocates a few hundred short-lived objects that reference counting frees,
so collecting the young generation every 10,000 allocations instead of 700
keeps a little cyclic garbage a little longer and spends about a
microsecond per request on collection instead of tens.

`llmquota serve`'s workers do this once started
(llmquota.api.app.create_app_from_env). The library never does it on its
own: a frozen object that is later part of a reference cycle is never
reclaimed, nor is anything it refers to, so freezing is for a moment the
process's owner chooses, after start-up and before traffic (a process
that builds many limiters or apps, as the tests do, would keep what it froze
of each). A latency-sensitive application that embeds the library calls
`llmquota.settle_after_startup()` itself, once its first limiter has
connected (README, "The library").
"""

from __future__ import annotations

import gc

YOUNG_COLLECTION_ALLOCATIONS = 10_000
"""Net allocations of container objects between two young-generation collections."""


def settle_after_startup() -> None:
    """Collect what start-up left behind, freeze the rest, and collect young objects less often.

    Process-wide: call it once, when the process has started (its limiter
    connected, its own caches loaded) and before it serves traffic."""
    gc.collect()
    gc.freeze()
    _young, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_COLLECTION_ALLOCATIONS, middle, old)
