"""Configuration in one place: the service's Settings and the commands' flag fallbacks.

Every LLMQUOTA_* variable is declared here (settings.py: the service;
commands.py: per-command flags), and settings.py is the one module that
reads or writes the environment.
"""

from llmquota.config.commands import COMMAND_DEFAULTS, CommandDefault, command_default
from llmquota.config.group_admission import (
    MAX_BATCH_SIZE,
    MAX_BATCH_WINDOW_SECONDS,
    MAX_BATCHES_IN_FLIGHT,
)
from llmquota.config.outbound import (
    MAX_DEPLOYMENT_COOLDOWN_FAILURES,
    MAX_DEPLOYMENT_COOLDOWN_SECONDS,
)
from llmquota.config.renames import ENV_PREFIX
from llmquota.config.settings import (
    DATA_DIR_ENV,
    DATABASE_URL_ENV,
    Settings,
    environment_value,
    export_for_workers,
)
from llmquota.config.upstreams import (
    WIRE_FORMATS,
    UpstreamConfig,
    UpstreamsFileError,
    WireFormat,
    route,
)

__all__ = [
    "COMMAND_DEFAULTS",
    "DATABASE_URL_ENV",
    "DATA_DIR_ENV",
    "ENV_PREFIX",
    "MAX_BATCHES_IN_FLIGHT",
    "MAX_BATCH_SIZE",
    "MAX_BATCH_WINDOW_SECONDS",
    "MAX_DEPLOYMENT_COOLDOWN_FAILURES",
    "MAX_DEPLOYMENT_COOLDOWN_SECONDS",
    "WIRE_FORMATS",
    "CommandDefault",
    "Settings",
    "UpstreamConfig",
    "UpstreamsFileError",
    "WireFormat",
    "command_default",
    "environment_value",
    "export_for_workers",
    "route",
]
