"""What a remote reservation holds, whichever client made it.

The sync and the async reservation (sync.py, asynchronous.py) differ only in
how they call the server; the figures of the admission, and the state a
block's exit looks at, are here once.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from llmquota.client.wire import Admitted
from llmquota.domain.errors import ReservationConflict
from llmquota.domain.settlement import Settlement
from llmquota.domain.vocabulary import Priority


class Held:
    """An admission's figures (the library Reservation's names) and whether it is finished."""

    def __init__(self, tenant: str, admitted: Admitted) -> None:
        self.tenant = tenant
        self.admitted = admitted
        self.reservation_id: uuid.UUID = admitted.reservation_id
        self.reserved_tokens = admitted.reserved_tokens
        self.input_tokens = admitted.input_tokens
        self.input_estimated = admitted.input_estimated
        self.model: str = admitted.model
        self.degraded = admitted.degraded
        # The deployment chosen among the request's upstreams (None: none named).
        self.upstream: str | None = admitted.upstream
        self.output_estimate: dict[str, Any] = admitted.output_estimate
        self.priority: Priority | None = admitted.priority
        self.lease_expires_at: datetime = admitted.lease_expires_at
        self.lease_generation = admitted.lease_generation
        self.settlement: Settlement | None = None
        self.released = False

    @property
    def finished(self) -> bool:
        """Settled or released through this object."""
        return self.settlement is not None or self.released


def released_anyway(exc: ReservationConflict) -> bool:
    """Whether a refused release at a block's exit still left nothing held.

    The lease ran out inside the block: the expiry already returned the
    capacity (as the library's Limiter.reservation treats it).
    """
    return exc.state == "expired"
