"""Settings renamed so that one word means one thing, and their old names.

`waiting` is for room (max_wait_ms), `queued` for a connection (the fair
share), `in_flight` for held permits. Three variables used those words for
something else and were renamed; a deployment that still sets an old name
keeps working for one release, with a warning naming the new one, and the
new name wins when both are set (`Settings` reads both through
AliasChoices, new first).
"""

from __future__ import annotations

import logging
import os

from pydantic import AliasChoices

ENV_PREFIX = "LLMQUOTA_"
log = logging.getLogger("llmquota.config")

# New field -> its deprecated variable.
RENAMED_VARIABLES: dict[str, str] = {
    "tenant_max_queued": f"{ENV_PREFIX}TENANT_MAX_WAITING",
    "tenant_max_waiting_for_room": f"{ENV_PREFIX}WAIT_QUEUE_PER_TENANT",
    "batch_max_running": f"{ENV_PREFIX}BATCH_MAX_IN_FLIGHT",
}


def renamed(field: str) -> AliasChoices:
    """The variables a renamed field reads: its own, then its deprecated old one."""
    return AliasChoices(f"{ENV_PREFIX}{field.upper()}", RENAMED_VARIABLES[field])


def warn_of_renamed_variables() -> None:
    """One warning for each deprecated variable the environment still sets."""
    for field, old in RENAMED_VARIABLES.items():
        if old in os.environ:
            log.warning(
                "%s is deprecated: set %s%s (read for one more release)",
                old,
                ENV_PREFIX,
                field.upper(),
            )
