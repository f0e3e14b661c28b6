"""How long a request a ceiling's ladder sheds may wait for room (issue 23).

Pure code. A ladder step may say `queue_ms`: a request it sheds waits up to
that long instead of taking its 429 at once. The step in force for a refusal
is the highest step that sheds the request (its priority is not admitted and
it is not small) whose `above` the request would take the ceiling past: the
same floors lq_shed_floor reads, so a request above 95% on a ladder whose
80% step queues and whose 95% step does not is refused at once, as the seed's
bands say.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from llmquota.domain.vocabulary import Priority, priority_rank


@dataclass(frozen=True, slots=True)
class LadderStep:
    """One step of a ceiling's ladder as the database stores it (migration 0008, 0025)."""

    above: float
    admit_mask: int
    small_request_tokens: int | None
    queue_ms: int | None

    def sheds(self, rank: int, reserved_tokens: int) -> bool:
        """Whether this step sheds a request of priority `rank` reserving that much."""
        admitted = (self.admit_mask >> rank) & 1 == 1
        small = self.small_request_tokens
        return not admitted and (small is None or reserved_tokens >= small)


def shed_wait_ms(
    ladder: Sequence[LadderStep],
    priority: Priority | None,
    reserved_tokens: int | None,
    utilization: float | None,
) -> int | None:
    """The wait for room the step in force grants a shed request; None: its 429 now.

    `utilization` is the ceiling's after the request, as the refusal reports
    it; `ladder` is in increasing order of `above`, as stored.
    """
    if priority is None or reserved_tokens is None or utilization is None:
        return None
    rank = priority_rank(priority)
    in_force: LadderStep | None = None
    for step in ladder:
        if utilization > step.above and step.sheds(rank, reserved_tokens):
            in_force = step
    return None if in_force is None else in_force.queue_ms
