"""What settling a reservation charged and gave back.

Pure data, in the domain so that every way of settling returns the same
type: the library's Reservation (admission/reservation.py) and the REST
client (llmquota.client), which must not import the services.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Settlement:
    """What settling charged and gave back."""

    charged_tokens: int
    refunded_tokens: int
    late: bool
    # Tokens above the request's possible maximum (counted input with a
    # tolerance, plus max_tokens): charged to the tenant, flagged in the
    # ledger, and kept off the shared layers (see lq_shared_charge_cap).
    excess_tokens: int = 0
    # The store did not answer: the outage journal holds the settle and
    # records it when the store is back (the figures above are the expected ones).
    journaled: bool = False
