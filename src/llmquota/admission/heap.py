"""A started worker's heap, frozen out of Python's cyclic garbage collector.

The collector's full collections walk every container object the process
has: a worker that has imported its libraries (SQLAlchemy, FastAPI,
pydantic, asyncpg) and loaded the policies of 10,000 tenants has about
160,000, and walking them stops the event loop, and every request waiting
on it, for 60 to 120 ms on this project's 2-core machine. At 5,000 admissions
a second such a collection came every few seconds and was the whole of the
library's p99 (BENCHMARKS.md, "Issue 25, fifth part").

Nearly all of those objects live as long as the process: modules, classes,
functions, the policy cache. `gc.freeze()` moves every object alive now to a
permanent generation that collections skip (the approach Instagram described
for its Django workers, and the one the `gc` module documents). Frozen
objects are still freed when their last reference goes; only a reference
cycle among them that becomes garbage later is never reclaimed, so the
collector first collects what is garbage already, and the freeze is done once
per process, when its first limiter has connected: start-up, not a moment in
the middle of traffic. A host application that would rather keep its own
collector as it is sets LLMQUOTA_GC_FREEZE_AT_START=false.
"""

from __future__ import annotations

import gc
import logging
import os

log = logging.getLogger(__name__)

# The processes whose start-up heap was frozen (a forked child freezes its own once).
_FROZEN_IN: set[int] = set()


def freeze_startup_heap(*, enabled: bool = True) -> bool:
    """Collect, then freeze every object alive, once per process (if `enabled`,
    LLMQUOTA_GC_FREEZE_AT_START); whether it did now."""
    if not enabled or os.getpid() in _FROZEN_IN:
        return False
    _FROZEN_IN.add(os.getpid())
    gc.collect()
    gc.freeze()
    log.debug("froze %d start-up objects out of the cyclic collector", gc.get_freeze_count())
    return True
