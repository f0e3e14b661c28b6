"""Configuration: every LLMQUOTA_* environment variable llmquota reads.

Two kinds, both declared here. `Settings` holds what the service itself
lives by: the database, pool sizes, timeouts, body size, sweeper batches,
admission batches. `COMMAND_DEFAULTS` holds the values of single commands
(`serve --port`, `ledger adjust --tokens`, ...): command-line flags, each
falling back to its variable, which the command's --help names.

Nothing else reads the environment: `Settings` (through pydantic-settings)
and `environment_value` are the only readers, and `export_for_workers` the
only writer. Nothing holds settings in a module global either: callers build
a Settings and pass it down.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Annotated

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from llmquota.domain.validation import MAX_ESTIMATE_FACTOR

# Bounds on the batching settings, so a typo cannot make a batch unbounded or
# a window a minute long (the Coalescer checks them too).
MAX_BATCH_SIZE = 10_000
MAX_BATCH_WINDOW_SECONDS = 1.0
MAX_BATCHES_IN_FLIGHT = 1_000

ENV_PREFIX = "LLMQUOTA_"
DATABASE_URL_ENV = f"{ENV_PREFIX}DATABASE_URL"
DATA_DIR_ENV = f"{ENV_PREFIX}DATA_DIR"


EstimateFactor = Annotated[float, Field(gt=0, le=MAX_ESTIMATE_FACTOR, allow_inf_nan=False)]


class Settings(BaseSettings):
    """Service configuration; each field is LLMQUOTA_<FIELD> in the environment."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

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
    key_cache_refresh_seconds: float = Field(
        default=30.0,
        gt=0.0,
        le=3_600.0,
        description="a cached API key used when older than this is looked up again in the "
        "background while the cached answer still serves; during an outage a known key "
        "keeps working for POLICY_CACHE_MAX_STALE_SECONDS",
    )
    key_negative_cache_seconds: float = Field(
        default=5.0,
        ge=0.0,
        le=3_600.0,
        description="how long a worker remembers (by digest) that a key does not exist, "
        "answering 401 without a database lookup; 0 turns it off",
    )
    auth_failures_per_second: float = Field(
        default=20.0,
        gt=0.0,
        le=100_000.0,
        description="failed authentications one client address may make per second per "
        "worker (refill of its bucket); past the burst, 429 without database work",
    )
    auth_failure_burst: int = Field(
        default=40,
        ge=1,
        le=1_000_000,
        description="failed authentications one client address may make at once per worker",
    )
    unknown_key_max_in_progress: int = Field(
        default=4,
        ge=1,
        le=10_000,
        description="requests with keys a worker does not know yet (each needing a database "
        "lookup) it serves at once, all clients together; the rest queue",
    )
    unknown_key_max_waiting: int = Field(
        default=64,
        ge=0,
        le=1_000_000,
        description="requests with keys a worker does not know yet queued per worker before 429",
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


def environment_value(variable: str, default: str | None = None) -> str | None:
    """The value of an environment variable (else `default`), as it is.

    Besides pydantic-settings filling `Settings`, the one place llmquota
    reads the environment.
    """
    return os.environ.get(variable, default)


def export_for_workers(database_url: str) -> None:
    """Put the resolved DSN into LLMQUOTA_DATABASE_URL for worker processes.

    `llmquota serve` resolves the database (perhaps starting the embedded
    server) once; uvicorn's workers are separate processes that build their
    own `Settings` from the environment they inherit.
    """
    os.environ[DATABASE_URL_ENV] = database_url


@dataclass(frozen=True, slots=True)
class CommandDefault:
    """A flag of one command and the LLMQUOTA_* variable it falls back to.

    `default` (a string, as it would be typed) applies when neither the flag
    nor the variable is given. With `via_settings` the variable is a
    `Settings` field: the flag's own default is None, and the setting (whose
    default --help shows) applies.
    """

    command: str
    flag: str
    env: str
    help: str = ""
    default: str | None = None
    env_note: str = ""
    via_settings: bool = False

    @property
    def variable(self) -> str:
        """The environment variable's full name."""
        return f"{ENV_PREFIX}{self.env}"

    @property
    def help_text(self) -> str:
        """The flag's --help: what it is, then the variable it falls back to."""
        note = self.env_note
        if self.via_settings:
            note += f" (default {Settings.model_fields[self.env.lower()].default})"
        named = f"env {self.variable}{note}"
        return f"{self.help}; {named}" if self.help else named

    def value(self) -> str | None:
        """The variable's value (even empty), else `default`; None via settings."""
        if self.via_settings:
            return None
        return environment_value(self.variable, self.default)


# The values of single commands, by command. The service's own settings (the
# database, timeouts, the sweeper's batches...) are the Settings fields above.
COMMAND_DEFAULTS: tuple[CommandDefault, ...] = (
    CommandDefault("serve", "--host", "HOST", default="127.0.0.1"),
    CommandDefault("serve", "--port", "PORT", default="8080"),
    CommandDefault("serve", "--workers", "WORKERS", "uvicorn worker processes", default="1"),
    CommandDefault(
        "serve",
        "--migrate",
        "MIGRATE_ON_START",
        "apply migrations before serving (always done on the embedded database)",
        default="0",
        env_note="=1",
    ),
    CommandDefault("serve", "--log-level", "LOG_LEVEL", default="info"),
    CommandDefault(
        "sweep", "--loop", "SWEEP_LOOP_SECONDS", "keep running, sweeping every SECONDS", "0"
    ),
    CommandDefault(
        "sweep", "--batch-size", "SWEEP_BATCH_SIZE", "reservations per statement", via_settings=True
    ),
    CommandDefault(
        "sweep", "--max-batches", "SWEEP_MAX_BATCHES", "statements per run", via_settings=True
    ),
    CommandDefault(
        "sweep",
        "--heartbeat-file",
        "SWEEP_HEARTBEAT_FILE",
        "write the time to PATH after each run (for healthchecks)",
    ),
    CommandDefault(
        "ledger export", "--after-id", "EXPORT_AFTER_ID", "print rows after this export id", "0"
    ),
    CommandDefault(
        "ledger export",
        "--limit",
        "EXPORT_LIMIT",
        "print at most N rows (default: until caught up)",
    ),
    CommandDefault("ledger adjust", "--tenant", "ADJUST_TENANT", "tenant (must exist)"),
    CommandDefault(
        "ledger adjust", "--tokens", "ADJUST_TOKENS", "signed token count, e.g. 1200 or -300"
    ),
    CommandDefault(
        "ledger adjust", "--reason", "ADJUST_REASON", "why (required; kept with the row)"
    ),
    CommandDefault(
        "ledger adjust",
        "--model",
        "ADJUST_MODEL",
        "model the tokens are priced as (default: none, unpriced)",
    ),
    CommandDefault("ledger adjust", "--route", "ADJUST_ROUTE", "route the tokens belong to"),
    CommandDefault(
        "ledger adjust",
        "--token-type",
        "ADJUST_TOKEN_TYPE",
        "whether the tokens are input or output tokens",
        "output",
    ),
    CommandDefault("prices set", "--model", "PRICE_MODEL", "model name, e.g. gpt-4o"),
    CommandDefault(
        "prices set",
        "--input-per-million",
        "PRICE_INPUT_PER_MILLION",
        "USD per million input tokens, e.g. 2.50",
    ),
    CommandDefault(
        "prices set",
        "--output-per-million",
        "PRICE_OUTPUT_PER_MILLION",
        "USD per million output tokens, e.g. 10.00",
    ),
    CommandDefault(
        "prices set",
        "--effective-from",
        "PRICE_EFFECTIVE_FROM",
        "YYYY-MM-DD (midnight UTC) or an ISO time with offset (default: now)",
    ),
    CommandDefault("prices list", "--model", "PRICE_MODEL", "only this model"),
    CommandDefault("prices list", "--format", "REPORT_FORMAT", "output format", "table"),
    CommandDefault("report", "--from", "REPORT_FROM", "first day, YYYY-MM-DD (UTC)"),
    CommandDefault("report", "--to", "REPORT_TO", "day after the last, YYYY-MM-DD (exclusive)"),
    CommandDefault("report", "--tenant", "REPORT_TENANT", "only this tenant"),
    CommandDefault("report", "--format", "REPORT_FORMAT", "output format", "table"),
)


def command_default(command: str, flag: str) -> CommandDefault:
    """The declaration of `flag` of `command` (e.g. "ledger adjust", "--tokens")."""
    for declared in COMMAND_DEFAULTS:
        if declared.command == command and declared.flag == flag:
            return declared
    raise KeyError(f"{command} {flag} is not declared in COMMAND_DEFAULTS")
