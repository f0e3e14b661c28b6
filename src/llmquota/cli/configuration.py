"""`llmquota config`: the effective settings, as this environment makes them.

What a process started here would run with (the environment, else each
default), grouped by topic as README.md's Configuration tables are, one
`LLMQUOTA_NAME=value` a line, secrets masked (llmquota.config.catalogue says
which). It reads no database: it answers the question "what did my
variables do?" before anything is started, also when PostgreSQL is away.
A variable that is unset prints as a comment (`# LLMQUOTA_DATA_DIR unset`):
an empty value would be a different setting.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from llmquota.config import Settings
from llmquota.config.catalogue import UNSET, Entry, entries


def _lines(shown: list[Entry]) -> list[str]:
    lines: list[str] = []
    topic = None
    for entry in shown:
        if entry.topic != topic:
            topic = entry.topic
            lines.extend([*([""] if lines else []), f"# {topic}"])
        if entry.value is None:
            lines.append(f"# {entry.variable} {UNSET}")
        else:
            lines.append(f"{entry.variable}={entry.value}")
    return lines


def cmd_config(args: argparse.Namespace, settings: Settings) -> int:
    """Print every setting's effective value, masked, by topic."""
    shown = entries(settings)
    if args.json:
        topics: dict[str, dict[str, str | None]] = {}
        for entry in shown:
            topics.setdefault(entry.topic, {})[entry.variable] = entry.value
        sys.stdout.write(json.dumps(topics, indent=2) + "\n")
    else:
        sys.stdout.write("\n".join(_lines(shown)) + "\n")
    return 0


def add_config_command(commands: Any) -> None:
    """`config [--json]`."""
    config = commands.add_parser(
        "config",
        help="print the effective settings (environment, else defaults), secrets masked",
    )
    config.add_argument(
        "--json",
        action="store_true",
        help='print {"topic": {"LLMQUOTA_NAME": value or null}} instead',
    )
    config.set_defaults(func=cmd_config)
