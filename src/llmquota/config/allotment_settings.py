"""The settings of allotted admission (admission/allotments.py).

A part of `Settings` (settings.py), which inherits these fields and reads
them from LLMQUOTA_* variables like every other; kept apart only so that
each module stays one page of one topic. Never built on its own. Nothing
here turns allotments on: a tenant's (or route's) policy does, with
`"admission": "allotted"`.
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings


class AllotmentSettings(BaseSettings):
    """How big a slice is, how often its admissions are journaled, how long it lives."""

    allotment_journal_ms: float = Field(
        default=20.0,
        gt=0,
        le=1_000,
        description="how often a worker journals what it admitted from its slices (one "
        "statement for all of them): a settle arriving at another worker sooner than this "
        "waits for it, and a worker that dies loses at most this long's admissions from "
        "the books (their room comes back with the slice: see docs/scaling.md)",
    )
    allotment_hold_seconds: int = Field(
        default=30,
        ge=2,
        le=3_600,
        description="how long a slice outlives its worker's last word: the sweeper returns "
        "slices past it (a worker that stopped without returning its own)",
    )
    allotment_share: float = Field(
        default=0.1,
        gt=0,
        le=1,
        description="the most of a layer's room one slice takes: slices shrink as the room "
        "does, and below one request's worth the layer is decided exactly again",
    )
    allotment_max_requests: int = Field(
        default=1_024,
        ge=1,
        le=100_000,
        description="the most requests one slice is topped up by at a time",
    )
