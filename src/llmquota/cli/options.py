"""Flags that fall back to LLMQUOTA_* variables, as `config.COMMAND_DEFAULTS` declares.

Each flag's variable, default and help text live in `llmquota.config`; the
commands add what only argparse cares about (type, choices, metavar...).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from typing import Any

from llmquota.config import command_default


def add_flag(
    parser: argparse.ArgumentParser,
    command: str,
    flag: str,
    *,
    required: bool = False,
    **kwargs: Any,
) -> None:
    """Add `flag` of `command`, falling back to its variable; --help names it.

    The variable's value is the default as typed (argparse applies `type` to
    it). A required flag is satisfied by its environment variable too.
    """
    declared = command_default(command, flag)
    fallback = declared.value()
    parser.add_argument(
        flag,
        default=fallback,
        required=required and fallback is None,
        help=declared.help_text,
        **kwargs,
    )


def add_converted_flag(
    parser: argparse.ArgumentParser,
    command: str,
    flag: str,
    convert: Callable[[str], Any],
    **kwargs: Any,
) -> None:
    """Add `flag` of `command` with its fallback converted now, when the parser
    is built; an empty variable counts as unset. For the service's own flags
    (serve, sweep), which have always been read this way.
    """
    declared = command_default(command, flag)
    value = declared.value() or declared.default
    parser.add_argument(
        flag,
        default=None if value is None else convert(value),
        help=declared.help_text,
        **kwargs,
    )


# A whole number as typed in a shell: ASCII digits with an optional leading
# `-`. int() also takes Arabic-Indic or fullwidth digits, `+7`, `1_000` and
# `' 12 '`; a count or an id typed that way is a mistake to point out, not a
# number to guess.
_INTEGER = re.compile(r"-?[0-9]+")


def ascii_integer(text: str) -> int:
    """argparse `type` for integer flags: ASCII digits only (see _INTEGER)."""
    if not _INTEGER.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a whole number in ASCII digits (e.g. 1200 or -300)"
        )
    return int(text)


def is_one(value: str) -> bool:
    """A switch variable: on when it is "1"."""
    return value == "1"
