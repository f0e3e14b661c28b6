"""Settings, read from LLMQUOTA_* environment variables.

Every limit the service itself lives by is here and named: pool sizes,
timeouts, body size, sweeper batches, admission batches. Nothing reads the environment
elsewhere, and nothing holds settings in a module global: callers build a
Settings and pass it down.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from llmquota.domain.validation import MAX_ESTIMATE_FACTOR

# Bounds on the batching settings, so a typo cannot make a batch unbounded or
# a window a minute long (the Coalescer checks them too).
MAX_BATCH_SIZE = 10_000
MAX_BATCH_WINDOW_SECONDS = 1.0
MAX_BATCHES_IN_FLIGHT = 1_000


EstimateFactor = Annotated[float, Field(gt=0, le=MAX_ESTIMATE_FACTOR, allow_inf_nan=False)]


class Settings(BaseSettings):
    """Service configuration; each field is LLMQUOTA_<FIELD> in the environment."""

    model_config = SettingsConfigDict(env_prefix="LLMQUOTA_", extra="ignore")

    database_url: str | None = Field(
        default=None, description="PostgreSQL DSN; unset runs an embedded PostgreSQL"
    )
    data_dir: str | None = Field(
        default=None, description="embedded PostgreSQL data directory (default: user data dir)"
    )
    admin_key: str | None = Field(
        default=None, description="admin API key; unset: `serve` generates one on first start"
    )
    estimate_factors: dict[str, EstimateFactor] = Field(
        default_factory=dict,
        description="per-model factor on o200k counts for models without a published "
        'tokenizer, JSON such as {"claude-*": 1.25}; default 1.25',
    )
    token_count_cpu_budget_ms: int = Field(
        default=250,
        ge=1,
        le=60_000,
        description="CPU one request's token count may take; past it the rest of the text "
        "is bounded by its UTF-8 length and the count is marked as an estimate",
    )
    token_count_inline_chars: int = Field(
        default=32_768,
        ge=0,
        le=10_000_000,
        description="messages with more characters than this are counted on a thread pool, "
        "off the event loop, one request per tenant at a time",
    )
    token_count_workers: int = Field(
        default=2, ge=1, le=64, description="threads counting big prompts, per worker"
    )
    pool_min_size: int = Field(default=2, ge=1, le=100)
    pool_max_size: int = Field(default=10, ge=1, le=200)
    statement_timeout_ms: int = Field(
        default=5_000, ge=10, le=600_000, description="server-side cap on any statement"
    )
    lock_timeout_ms: int = Field(default=2_000, ge=10, le=600_000)
    concurrency_retry_ms: int = Field(
        default=1_000, ge=1, le=600_000, description="retry hint for a concurrency refusal"
    )
    max_body_bytes: int = Field(default=1_048_576, ge=1_024, le=64 * 1_048_576)
    sweep_batch_size: int = Field(default=500, ge=1, le=10_000)
    sweep_max_batches: int = Field(default=100, ge=1, le=100_000)
    decision_deadline_ms: int = Field(
        default=250,
        ge=1,
        le=600_000,
        description="longest a decision waits for the database before the failure mode applies",
    )
    outage_local_fraction: float = Field(
        default=0.25,
        gt=0.0,
        le=1.0,
        description="share of each limit a worker may admit on its own in failure mode local",
    )
    outage_journal_max_entries: int = Field(
        default=100_000,
        ge=1,
        le=10_000_000,
        description="admissions a worker may hold unrecorded during an outage",
    )
    outage_spool_dir: str | None = Field(
        default=None,
        description="directory for fsync'd outage journal files (unset: memory only)",
    )
    outage_flush_batch_size: int = Field(default=500, ge=1, le=10_000)
    outage_probe_seconds: float = Field(
        default=0.5, gt=0.0, le=60.0, description="retry interval while recording an outage"
    )
    policy_cache_refresh_seconds: float = Field(
        default=10.0, gt=0.0, le=3_600.0, description="how often workers reload policies"
    )
    policy_cache_max_stale_seconds: float = Field(
        default=3_600.0,
        gt=0.0,
        le=7 * 86_400.0,
        description="oldest cached policies a worker decides by during an outage",
    )
    policy_cache_max_layers: int = Field(default=100_000, ge=1, le=10_000_000)
    tenant_max_in_progress: int = Field(
        # High enough that one busy tenant's admissions still share batches
        # (group admission); low enough that a flood queues in its own line.
        default=32,
        ge=1,
        le=10_000,
        description="requests of one tenant a worker serves at once; the rest queue",
    )
    tenant_max_waiting: int = Field(
        default=256,
        ge=0,
        le=1_000_000,
        description="requests of one tenant queued per worker before 429",
    )
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
    batch_max_in_flight: int = Field(
        default=2,
        ge=1,
        le=MAX_BATCHES_IN_FLIGHT,
        description="batch statements of each kind (admit, finish) running at once; each "
        "holds a pooled connection",
    )
    admission_synchronous_commit: bool = Field(
        default=True,
        description="false: admission statements commit without waiting for the WAL flush "
        "(settlement and the ledger always wait); a crash may then forget the admissions "
        "of its last few hundred milliseconds, see BENCHMARKS.md",
    )
    retention_seconds: int = Field(
        default=7 * 86_400,
        ge=86_400,
        description="how long finished reservations (and their idempotency keys) are kept",
    )
    ledger_months_ahead: int = Field(
        default=3,
        ge=1,
        le=24,
        description="monthly ledger partitions each sweeper run keeps ready beyond this month",
    )
    reporting_database_url: str | None = Field(
        default=None,
        description="DSN for `llmquota report` (e.g. as llmquota_reporting); unset: DATABASE_URL",
    )
    report_statement_timeout_ms: int = Field(
        default=120_000, ge=1_000, le=3_600_000, description="server-side cap on one report"
    )
    export_page_rows: int = Field(
        default=1_000, ge=1, le=10_000, description="ledger rows per export round trip"
    )
    export_number_limit: int = Field(
        default=10_000,
        ge=1,
        le=1_000_000,
        description="ledger rows the export numbers (gives export ids) per round trip",
    )
