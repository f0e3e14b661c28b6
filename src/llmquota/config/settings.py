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
from typing import Annotated, Self

from pydantic import Field, PrivateAttr, model_validator
from pydantic_settings import SettingsConfigDict

from llmquota.config.allotment_settings import AllotmentSettings
from llmquota.config.group_admission import GroupAdmissionSettings
from llmquota.config.outbound import OutboundSettings
from llmquota.config.renames import ENV_PREFIX, renamed, warn_of_renamed_variables
from llmquota.config.reports import ReportSettings
from llmquota.config.upstreams import (
    EVERY_MODEL,
    RoutingRule,
    UpstreamConfig,
    check_names,
    load_upstreams_file,
)
from llmquota.domain.validation import MAX_ESTIMATE_FACTOR

DATABASE_URL_ENV = f"{ENV_PREFIX}DATABASE_URL"
DATA_DIR_ENV = f"{ENV_PREFIX}DATA_DIR"


EstimateFactor = Annotated[float, Field(gt=0, le=MAX_ESTIMATE_FACTOR, allow_inf_nan=False)]


class Settings(OutboundSettings, ReportSettings, AllotmentSettings, GroupAdmissionSettings):
    """Service configuration; each field is LLMQUOTA_<FIELD> in the environment."""

    # Errors never echo the values: a provider key must not reach a traceback.
    # populate_by_name: a renamed field reads its new variable or, for one
    # release, its old one (RENAMED_VARIABLES), and is still set by name in code.
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, extra="ignore", hide_input_in_errors=True, populate_by_name=True
    )
    _upstreams: tuple[UpstreamConfig, ...] = PrivateAttr(default=())
    _routing: tuple[RoutingRule, ...] = PrivateAttr(default=())

    database_url: str | None = Field(
        default=None,
        description="PostgreSQL DSN, a libpq URL (several hosts with "
        "target_session_attrs=read-write: a primary and its standbys); unset runs an embedded "
        "PostgreSQL",
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
    transaction_pooler: bool = Field(
        default=False,
        description="DATABASE_URL is a pooler in transaction mode (PgBouncer): no startup "
        "parameters but application_name, no prepared-statement cache, no session reset; "
        "the statement and lock timeouts are then the role's (docs/operations.md)",
    )
    change_notifications: bool = Field(
        default=True,
        description="each worker LISTENs on one direct connection and applies policy, plan, "
        "ceiling, quota and key changes as they commit",
    )
    listen_database_url: str | None = Field(
        default=None,
        description="DSN of that connection and of the maintenance lock (direct, never a "
        "pooler); unset: DATABASE_URL, none with TRANSACTION_POOLER",
    )
    pool_min_size: int = Field(
        default=2, ge=1, le=100, description="database connections each worker keeps open"
    )
    pool_max_size: int = Field(
        default=10, ge=1, le=200, description="most database connections each worker opens"
    )
    statement_timeout_ms: int = Field(
        default=5_000, ge=10, le=600_000, description="server-side cap on any statement"
    )
    lock_timeout_ms: int = Field(
        default=2_000, ge=10, le=600_000, description="server-side cap on waiting for a row lock"
    )
    migrate_lock_timeout_ms: int = Field(
        default=1_000,
        ge=0,
        le=600_000,
        description="longest a migration statement waits for a table lock (0: no limit); "
        "then its revision is rolled back and tried again",
    )
    migrate_lock_attempts: int = Field(
        default=10,
        ge=1,
        le=100,
        description="tries of a migration step whose lock waits run out, 1, 2, 4, 8, "
        "then 15 s apart",
    )
    concurrency_retry_ms: int = Field(
        default=1_000, ge=1, le=600_000, description="retry hint for a concurrency refusal"
    )
    max_body_bytes: int = Field(
        default=1_048_576,
        ge=1_024,
        le=64 * 1_048_576,
        description="largest request body; a larger one gets 413 (a chunked one as it passes this)",
    )
    sweep_batch_size: int = Field(
        default=500, ge=1, le=10_000, description="lapsed reservations one sweep statement expires"
    )
    sweep_max_batches: int = Field(
        default=100, ge=1, le=100_000, description="sweep statements per run, at most"
    )
    serve_sweeper: bool = Field(
        default=True,
        description="`serve` runs the sweeper: one leader across all workers and replicas",
    )
    sweep_interval_seconds: float = Field(
        default=5.0, ge=0.1, le=3_600.0, description="how often the maintenance leader sweeps"
    )
    maintenance_retry_seconds: float = Field(
        default=1.0,
        ge=0.1,
        le=60.0,
        description="how often a process that does not lead tries the maintenance lock",
    )
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
    outage_flush_batch_size: int = Field(
        default=500,
        ge=1,
        le=10_000,
        description="outage journal entries recorded per statement when the database is back",
    )
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
    policy_cache_max_layers: int = Field(
        default=100_000,
        ge=1,
        le=10_000_000,
        description="limit layers a worker's policy cache holds; those beyond count as closed "
        "during an outage",
    )
    estimate_refresh_seconds: float = Field(
        default=5.0,
        gt=0.0,
        le=3_600.0,
        description="how often workers reload the learned output estimates that changed",
    )
    estimate_cache_max_keys: int = Field(
        default=100_000,
        ge=1,
        le=10_000_000,
        description="learned (tenant, route, model) histograms a worker keeps; the rest "
        "reserve max_tokens",
    )
    tenant_max_in_progress: int = Field(
        # High enough that one busy tenant's admissions still share batches
        # (group admission); low enough that a flood queues in its own line.
        default=32,
        ge=1,
        le=10_000,
        description="requests of one tenant a worker serves at once; the rest queue",
    )
    tenant_max_queued: int = Field(
        default=256,
        ge=0,
        le=1_000_000,
        validation_alias=renamed("tenant_max_queued"),
        description="requests of one tenant queued per worker for a connection (past "
        "TENANT_MAX_IN_PROGRESS) before 429; was TENANT_MAX_WAITING",
    )
    max_wait_ms_cap: int = Field(
        default=30_000,
        ge=0,
        le=600_000,
        description="largest max_wait_ms an admission may ask for (422 above it); 0 turns "
        "waiting off",
    )
    tenant_max_waiting_for_room: int = Field(
        default=64,
        ge=0,
        le=100_000,
        validation_alias=renamed("tenant_max_waiting_for_room"),
        description="admissions of one tenant a worker holds waiting for room (max_wait_ms); "
        "past it 429 at once; was WAIT_QUEUE_PER_TENANT",
    )
    ceiling_metrics_refresh_seconds: float = Field(
        default=5.0,
        gt=0.0,
        le=3_600.0,
        description="how often a worker reads the provider ceilings' utilization (and, when "
        "enabled, the tenants') into its gauges",
    )
    decision_counts_flush_seconds: float = Field(
        default=5.0,
        ge=0.1,
        le=60.0,
        description="how often a worker adds its decision counts to the database (one "
        "statement each time), for the console's decisions-per-minute chart",
    )
    console_session_seconds: int = Field(
        default=8 * 3_600,
        ge=60,
        le=7 * 86_400,
        description="how long a console sign-in lasts (the session cookie and its row)",
    )
    tenant_utilization_metrics: bool = Field(
        default=False,
        description="export a utilization gauge per tenant (one series per tenant with a "
        "token limit, at most MAX_TENANT_UTILIZATION_SERIES)",
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
        description="keys a worker does not know yet that it looks up at once (each a "
        "database lookup, all clients together); the rest queue, and a key's further "
        "requests wait for its first",
    )
    unknown_key_max_waiting: int = Field(
        default=64,
        ge=0,
        le=1_000_000,
        description="keys a worker does not know yet queued for a lookup per worker before "
        "429 (a key's further requests wait for its first, up to TENANT_MAX_QUEUED)",
    )
    refusal_memory_ms: int = Field(
        default=100,
        ge=0,
        le=100,
        description="how long a worker answers a tenant's repeats of a request refused as "
        "rate limited from memory (never past the refusal's retry hint); a settlement in another "
        "worker can make room sooner, so this bounds how long a refusal can be wrong. "
        "0: every request is decided by the store",
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
    body_read_timeout_seconds: float = Field(
        default=10.0,
        gt=0.0,
        le=300.0,
        description="time a request body has to arrive whole once the app reads it; past it "
        "408 and the connection is closed",
    )
    header_read_timeout_seconds: float = Field(
        default=10.0,
        gt=0.0,
        le=300.0,
        description="time a request head has to arrive whole, from its first byte (from the "
        "connection's opening for the first request); past it 408, or a quiet close if no "
        "byte came",
    )
    max_header_bytes: int = Field(
        default=65_536,
        ge=8_192,
        le=1_048_576,
        description="largest request head (request line and headers); a larger one gets 400",
    )
    metrics_token: str | None = Field(
        default=None,
        min_length=16,
        description="bearer token GET /metrics requires; unset: /metrics is open",
    )

    @model_validator(mode="after")
    def _warn_of_renamed_variables(self) -> Self:
        """A deprecated variable still works, and says what it is called now."""
        warn_of_renamed_variables()
        return self

    @model_validator(mode="after")
    def _upstreams_are_whole(self) -> Self:
        """A base URL without its key (or a key without its URL) is a mistake, not a default."""
        for name in ("openai", "anthropic"):
            url, key = getattr(self, f"{name}_base_url"), getattr(self, f"{name}_api_key")
            if (url is None) != (key is None):
                have, missing = ("BASE_URL", "API_KEY") if key is None else ("API_KEY", "BASE_URL")
                raise ValueError(
                    f"{ENV_PREFIX}{name.upper()}_{have} is set without "
                    f"{ENV_PREFIX}{name.upper()}_{missing}"
                )
        self._upstreams = self._read_upstreams()
        return self

    def _read_upstreams(self) -> tuple[UpstreamConfig, ...]:
        """The file's upstreams first (routing by their models), then the simple ones."""
        found: list[UpstreamConfig] = []
        if self.upstreams_file is not None:
            declared, self._routing = load_upstreams_file(self.upstreams_file, environment_value)
            found.extend(declared)
        for form in ("openai", "anthropic"):
            url, key = getattr(self, f"{form}_base_url"), getattr(self, f"{form}_api_key")
            if url is not None and key is not None:
                found.append(UpstreamConfig(form, form, url, key, EVERY_MODEL))
        check_names(found, self.upstreams_file)
        return tuple(found)

    def upstreams(self) -> tuple[UpstreamConfig, ...]:
        """Every configured upstream, checked when the settings were built."""
        return self._upstreams

    def routing(self) -> tuple[RoutingRule, ...]:
        """The upstreams file's [[routing]] rules, in file order (the first that matches)."""
        return self._routing


def environment_value(variable: str, default: str | None = None) -> str | None:
    """The value of an environment variable (else `default`), as it is.

    Besides pydantic-settings filling `Settings`, the one place llmquota
    reads the environment.
    """
    return os.environ.get(variable, default)


def export_for_workers(database_url: str, listen: tuple[str, int] | None = None) -> None:
    """Put the resolved DSN into LLMQUOTA_DATABASE_URL for worker processes, and
    where serve listens into LLMQUOTA_SERVE_LISTEN.

    `llmquota serve` resolves the database (perhaps starting the embedded
    server) once; uvicorn's workers are separate processes that build their
    own `Settings` from the environment they inherit.
    """
    os.environ[DATABASE_URL_ENV] = database_url
    if listen is not None:
        os.environ[f"{ENV_PREFIX}SERVE_LISTEN"] = f"{listen[0]}:{listen[1]}"
