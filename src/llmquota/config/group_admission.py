"""The settings of group admission: how a process's admissions are batched and committed.

A part of `Settings` (settings.py), which inherits these fields and reads
them from LLMQUOTA_* variables like every other; kept apart only so that
each module stays one page of one topic. Never built on its own. What they
tune is admission/batching.py's Coalescer and the admission statements'
commit.
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings

from llmquota.config.renames import renamed

# Bounds on the batching settings, so a typo cannot make a batch unbounded or
# a window a minute long (the Coalescer checks them too).
MAX_BATCH_SIZE = 10_000
MAX_BATCH_WINDOW_SECONDS = 1.0
MAX_BATCHES_IN_FLIGHT = 1_000


class GroupAdmissionSettings(BaseSettings):
    """Batches of admissions and settlements, and their commit."""

    batching: bool = Field(
        default=True,
        description="coalesce concurrent admissions (and settlements) of one process into "
        "one statement per batch; false: one statement per request",
    )
    batch_max_size: int = Field(
        default=256, ge=1, le=MAX_BATCH_SIZE, description="requests decided by one statement"
    )
    batch_window_ms: float = Field(
        default=1.0,
        ge=0,
        le=MAX_BATCH_WINDOW_SECONDS * 1_000,
        description="how long a request may wait for others while a batch is already in "
        "flight; a request arriving when nothing is in flight goes at once",
    )
    batch_max_running: int = Field(
        default=2,
        ge=1,
        le=MAX_BATCHES_IN_FLIGHT,
        validation_alias=renamed("batch_max_running"),
        description="batch statements of each kind (admit, finish) running at once; each "
        "holds a pooled connection; was BATCH_MAX_IN_FLIGHT",
    )
    admission_synchronous_commit: bool = Field(
        default=True,
        description="false: admission statements commit without waiting for the WAL flush "
        "(settlement and the ledger always wait); a crash may then forget the admissions "
        "of its last few hundred milliseconds, see BENCHMARKS.md",
    )
