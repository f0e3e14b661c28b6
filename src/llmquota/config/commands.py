"""The commands' flags that fall back to LLMQUOTA_* variables, declared beside Settings.

Per-command values (a sweep's loop, an adjustment's tokens and reason, a
report's period) are CLI arguments; each may come from its variable instead,
and `--help` names it. They are read through settings.environment_value, the
one reader of the environment.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmquota.config.renames import ENV_PREFIX
from llmquota.config.settings import Settings, environment_value


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
    CommandDefault("serve", "--host", "HOST", "address to listen on", default="127.0.0.1"),
    CommandDefault("serve", "--port", "PORT", "port to listen on", default="8080"),
    CommandDefault("serve", "--workers", "WORKERS", "uvicorn worker processes", default="1"),
    CommandDefault(
        "serve",
        "--migrate",
        "MIGRATE_ON_START",
        "apply migrations before serving (always done on the embedded database)",
        default="0",
        env_note="=1",
    ),
    CommandDefault(
        "serve",
        "--log-level",
        "LOG_LEVEL",
        "uvicorn's log level (critical to trace)",
        default="info",
    ),
    CommandDefault(
        "serve",
        "--access-log",
        "ACCESS_LOG",
        "log a line per request (uvicorn's access log; off: a formatted, written line "
        "per admission costs CPU on the hot path)",
        default="0",
        env_note="=1",
    ),
    CommandDefault(
        "sweep", "--loop", "SWEEP_LOOP_SECONDS", "keep running, sweeping every SECONDS", "0"
    ),
    CommandDefault(
        "rebalance",
        "--loop",
        "REBALANCE_LOOP_SECONDS",
        "keep running, moving unused room and free in-flight permits between the cells' "
        "slices of shared limits every SECONDS",
        "0",
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
    CommandDefault(
        "prices set", "--model", "PRICE_MODEL", "model name or * glob, e.g. gpt-4o or gpt-4o*"
    ),
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
    CommandDefault(
        "prices set", "--set-by", "PRICE_SET_BY", "who sets this price (kept with the version)"
    ),
    CommandDefault(
        "prices set",
        "--backdate",
        "PRICE_BACKDATE",
        "why a price taking effect in the past (this month only) may reprice recorded usage",
    ),
    CommandDefault("prices list", "--model", "PRICE_MODEL", "only this model"),
    CommandDefault("prices list", "--format", "REPORT_FORMAT", "output format", "table"),
    CommandDefault("report", "--from", "REPORT_FROM", "first day, YYYY-MM-DD (UTC)"),
    CommandDefault("report", "--to", "REPORT_TO", "day after the last, YYYY-MM-DD (exclusive)"),
    CommandDefault("report", "--tenant", "REPORT_TENANT", "only this tenant"),
    CommandDefault(
        "report",
        "--days",
        "REPORT_DAYS",
        "oversubscription: the last N days up to now, 1 to 366 (default 7)",
    ),
    CommandDefault("report", "--ceiling", "REPORT_CEILING", "oversubscription: only this ceiling"),
    CommandDefault("report", "--format", "REPORT_FORMAT", "output format", "table"),
    CommandDefault("estimates", "--tenant", "ESTIMATES_TENANT", "only this tenant"),
    CommandDefault("estimates", "--model", "ESTIMATES_MODEL", "only this model"),
    CommandDefault("estimates", "--format", "REPORT_FORMAT", "output format", "table"),
)


def command_default(command: str, flag: str) -> CommandDefault:
    """The declaration of `flag` of `command` (e.g. "ledger adjust", "--tokens")."""
    for declared in COMMAND_DEFAULTS:
        if declared.command == command and declared.flag == flag:
            return declared
    raise KeyError(f"{command} {flag} is not declared in COMMAND_DEFAULTS")
