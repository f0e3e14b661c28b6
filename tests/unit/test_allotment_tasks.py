"""An allotment worker's background tasks are waited for without spinning.

A finished task leaves `Allotments._tasks` by a done callback, which runs on
the next turn of the event loop. On Python 3.12+, awaiting `asyncio.gather`
of tasks that are all finished does not yield to the loop, so the old
`while tasks: await gather(*tasks)` in `background_done` (and `close`, which
calls it) spun for ever once it met such a task: CI's Python 3.13 leg timed
out in it. On 3.11 gather yields, so there this test passes either way.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

from llmquota.admission.allotments import Allotments
from llmquota.admission.policy_cache import PolicyCache
from llmquota.config import Settings


async def test_background_done_returns_while_a_finished_task_is_still_in_the_set() -> None:
    settings = Settings(_env_file=None)  # type: ignore[call-arg]
    policies = PolicyCache(refresh_seconds=10, max_stale_seconds=60)
    allotments = Allotments(cast(Any, None), settings, policies, lambda _decisions: None)

    async def quick() -> None:
        return None

    allotments._spawn(quick())
    await asyncio.sleep(0)  # it runs and finishes; it leaves the set on the next turn
    assert allotments._tasks and all(task.done() for task in allotments._tasks)
    await allotments.background_done()
    assert not allotments._tasks
