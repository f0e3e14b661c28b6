"""The settings as a reader sees them: by topic, as typed, secrets masked.

README.md's Configuration tables and `llmquota config` show the same
catalogue: every `Settings` field under one topic (TOPICS, in README order),
its default and its value written as one would set them in the environment
(`true`, `5`, `{"claude-*": 1.25}`), and its description. Keeping the
grouping here, beside the fields, is what lets a unit test hold the README to
it: a new field without a topic fails, and so does a README row whose
default is not the model's. The variables of single commands' flags
(COMMAND_DEFAULTS) follow, under one topic of their own.

Shown values never carry a secret. A field whose name ends in `_key`,
`_token`, `_secret` or `_password`, or whose type is `SecretStr`, shows only
whether it is set; a `_url` field shows its URL with the credentials it
embeds (a DSN's password, a `?password=` or `?token=` parameter) masked.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import SecretStr
from pydantic.fields import FieldInfo

from llmquota.config.commands import COMMAND_DEFAULTS, CommandDefault
from llmquota.config.renames import ENV_PREFIX
from llmquota.config.settings import Settings
from llmquota.domain.url_masking import MASK, mask_url

# Every Settings field, once, by topic; the README's Configuration section
# has one table per topic, in this order.
TOPICS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "Database",
        (
            "database_url",
            "data_dir",
            "transaction_pooler",
            "pool_min_size",
            "pool_max_size",
            "statement_timeout_ms",
            "lock_timeout_ms",
            "migrate_lock_timeout_ms",
            "migrate_lock_attempts",
        ),
    ),
    (
        "Announced changes",
        (
            "change_notifications",
            "listen_database_url",
        ),
    ),
    (
        "Token counting",
        (
            "estimate_factors",
            "token_count_cpu_budget_ms",
            "token_count_inline_chars",
            "token_count_workers",
        ),
    ),
    (
        "Group admission",
        (
            "batching",
            "batch_max_size",
            "batch_window_ms",
            "batch_max_running",
            "admission_synchronous_commit",
        ),
    ),
    (
        "Allotments",
        (
            "allotment_journal_ms",
            "allotment_hold_seconds",
            "allotment_share",
            "allotment_max_requests",
        ),
    ),
    (
        "Refusals and waiting",
        (
            "concurrency_retry_ms",
            "refusal_memory_ms",
            "max_wait_ms_cap",
            "tenant_max_waiting_for_room",
        ),
    ),
    (
        "Fair share",
        (
            "tenant_max_in_progress",
            "tenant_max_queued",
        ),
    ),
    (
        "Authentication",
        (
            "admin_key",
            "key_cache_refresh_seconds",
            "key_negative_cache_seconds",
            "auth_failures_per_second",
            "auth_failure_burst",
            "unknown_key_max_in_progress",
            "unknown_key_max_waiting",
        ),
    ),
    (
        "HTTP edge",
        (
            "max_body_bytes",
            "header_read_timeout_seconds",
            "body_read_timeout_seconds",
            "max_header_bytes",
        ),
    ),
    (
        "Outages and the policy cache",
        (
            "decision_deadline_ms",
            "outage_local_fraction",
            "outage_journal_max_entries",
            "outage_spool_dir",
            "outage_flush_batch_size",
            "outage_probe_seconds",
            "policy_cache_refresh_seconds",
            "policy_cache_max_stale_seconds",
            "policy_cache_max_layers",
        ),
    ),
    (
        "Learned output estimates",
        (
            "estimate_refresh_seconds",
            "estimate_cache_max_keys",
        ),
    ),
    (
        "Metrics",
        (
            "metrics_token",
            "ceiling_metrics_refresh_seconds",
            "tenant_utilization_metrics",
        ),
    ),
    (
        "Console",
        (
            "console_session_seconds",
            "decision_counts_flush_seconds",
        ),
    ),
    (
        "Maintenance",
        (
            "serve_sweeper",
            "sweep_interval_seconds",
            "maintenance_retry_seconds",
            "sweep_batch_size",
            "sweep_max_batches",
            "retention_seconds",
            "ledger_months_ahead",
        ),
    ),
    (
        "Ledger export and reports",
        (
            "reporting_database_url",
            "report_statement_timeout_ms",
            "oversubscription_warn_ratio",
            "oversubscription_critical_ratio",
            "export_page_rows",
            "export_number_limit",
        ),
    ),
    (
        "Alert delivery",
        (
            "alert_delivery",
            "alert_delivery_interval_seconds",
            "alert_delivery_batch_size",
            "alert_delivery_timeout_seconds",
            "alert_delivery_per_destination",
            "alert_delivery_claim_seconds",
            "webhook_allowed_networks",
            "serve_listen",
        ),
    ),
    (
        "Ceiling alerts",
        (
            "ceiling_alerts",
            "ceiling_alert_interval_seconds",
            "ceiling_alert_hysteresis",
            "ceiling_alert_quiet_seconds",
        ),
    ),
    (
        "Proxy mode",
        (
            "openai_base_url",
            "openai_api_key",
            "anthropic_base_url",
            "anthropic_api_key",
            "upstreams_file",
            "proxy_default_max_tokens",
            "proxy_count_tokens",
            "proxy_disconnect",
            "proxy_drain_seconds",
            "proxy_client_stall_seconds",
            "proxy_heartbeat_seconds",
            "proxy_connect_timeout_seconds",
            "proxy_read_timeout_seconds",
            "proxy_max_connections",
            "proxy_tenant_connection_share",
            "proxy_pool_wait_ms",
            "proxy_tenant_max_drains",
            "proxy_ceiling_cooldown_seconds",
            "proxy_deployment_cooldown_seconds",
            "proxy_deployment_cooldown_failures",
        ),
    ),
)
# The topic of the per-command flags' variables (COMMAND_DEFAULTS).
COMMANDS_TOPIC = "Command flags"
_SECRET_SUFFIXES = ("_key", "_token", "_secret", "_password")
UNSET = "unset"


@dataclass(frozen=True, slots=True)
class Entry:
    """One variable as shown: its topic, name, value as typed (None: unset), meaning."""

    topic: str
    variable: str
    value: str | None
    meaning: str


def is_secret(name: str, field: FieldInfo) -> bool:
    """Whether a field's value, when set, is shown only as `***`."""
    return name.endswith(_SECRET_SUFFIXES) or _is_secret_type(field.annotation)


def _is_secret_type(annotation: Any) -> bool:
    if annotation is SecretStr:
        return True
    return any(_is_secret_type(arg) for arg in getattr(annotation, "__args__", ()))


def as_typed(value: Any) -> str | None:
    """A value as one would set it in the environment; None for unset."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, float):
        return repr(value).removesuffix(".0")
    if isinstance(value, dict | list):
        return json.dumps(value)
    return str(value)


def shown(name: str, field: FieldInfo, value: Any) -> str | None:
    """The value of field `name` fit to print: secrets masked (None: unset)."""
    text = as_typed(value)
    if text is None or text == "":
        return text
    if is_secret(name, field):
        return MASK
    if name.endswith("_url"):
        # A libpq keyword DSN ("host=... password=...") is not taken apart: hidden whole.
        return mask_url(text) if "://" in text else MASK
    return text


def default_of(field: FieldInfo) -> Any:
    """A field's default, its factory's product included."""
    return field.get_default(call_default_factory=True)


def entries(settings: Settings | None = None) -> list[Entry]:
    """Every setting, by topic: its effective value in `settings`, else its default;
    then the per-command flags' variables (command_entries)."""
    fields = Settings.model_fields
    found = []
    for title, names in TOPICS:
        for name in names:
            field = fields[name]
            value = default_of(field) if settings is None else getattr(settings, name)
            variable = f"{ENV_PREFIX}{name.upper()}"
            found.append(Entry(title, variable, shown(name, field, value), field.description or ""))
    return found + command_entries(effective=settings is not None)


def command_entries(*, effective: bool) -> list[Entry]:
    """The variables of COMMAND_DEFAULTS that are not Settings fields, each once
    with every flag it stands for. With `effective`, each value as the
    environment gives it (else the flag's default); without, the flag's default."""
    flags: dict[str, list[str]] = {}
    first: dict[str, CommandDefault] = {}
    for declared in COMMAND_DEFAULTS:
        if not declared.via_settings:
            flags.setdefault(declared.variable, []).append(f"{declared.command} {declared.flag}")
            first.setdefault(declared.variable, declared)
    found = []
    for variable, used_by in flags.items():
        declared = first[variable]
        value = declared.value() if effective else declared.default
        meaning = ", ".join(f"`{flag}`" for flag in used_by)
        if declared.help:
            meaning += f": {declared.help}"
        found.append(Entry(COMMANDS_TOPIC, variable, value, meaning))
    return found
