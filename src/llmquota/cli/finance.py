"""`llmquota ledger`, `prices` and `report`: the finance commands.

Each runs on one connection: the service's database, or for reports
LLMQUOTA_REPORTING_DATABASE_URL when set.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, Literal

from llmquota.cli.options import add_flag, ascii_integer
from llmquota.config import Settings
from llmquota.domain.errors import (
    InvalidRequest,
    LimiterError,
    UnknownName,
    UnknownReport,
    UnknownTenant,
)
from llmquota.store.cells import CellsError
from llmquota.store.connection import Connection, DatabaseError
from llmquota.store.database import open_database


def _run_on_connection(
    settings: Settings,
    action: Callable[[Connection], Awaitable[int]],
    *,
    reporting: bool = False,
    cells: Literal["refuse", "every", "first"] = "refuse",
    tenant: str | None = None,
) -> int:
    """Open the database and one connection, run `action`, and turn refusals
    into a message and an exit status (2: bad input, 1: anything else).

    Reports use LLMQUOTA_REPORTING_DATABASE_URL when it is set (e.g. as the
    read-only llmquota_reporting role), otherwise the service's database.

    In a database of cells (its `public` DSN), a command about a `tenant`
    runs in the tenant's cell; otherwise `cells` says where: in `every` cell
    (prices, which every cell keeps alike), the `first` (reading them back),
    or nowhere (`refuse`: the command names one cell's rows, and is run at
    that cell's DSN).
    """
    from llmquota.domain.cells import cell_of
    from llmquota.store.cells import deployments_of
    from llmquota.store.connection import open_connection

    async def run_on(dsn: str) -> int:
        connection = await open_connection(
            dsn,
            statement_timeout_ms=statement_timeout_ms(settings, reporting),
            lock_timeout_ms=settings.lock_timeout_ms,
            transaction_pooler=settings.transaction_pooler and not reporting,
        )
        try:
            return await action(connection)
        finally:
            await connection.close()

    async def run(dsn: str) -> int:
        deployments = [cell_dsn for _, cell_dsn in await deployments_of(dsn)]
        if len(deployments) > 1:
            if tenant is not None:
                deployments = [deployments[cell_of(tenant, len(deployments)) - 1]]
            elif cells == "first":
                deployments = deployments[:1]
            elif cells == "refuse":
                raise InvalidRequest(
                    f"this database holds {len(deployments)} cells: run this command at a "
                    "cell's DSN (search_path=cell_k)"
                )
        return max([await run_on(cell_dsn) for cell_dsn in deployments])

    return run_on_database(settings, run, reporting=reporting)


def statement_timeout_ms(settings: Settings, reporting: bool) -> int:
    """A report's statement timeout, or any other command's."""
    return settings.report_statement_timeout_ms if reporting else settings.statement_timeout_ms


def run_on_database(
    settings: Settings, run: Callable[[str], Coroutine[Any, Any, int]], *, reporting: bool
) -> int:
    """Open the database (the reporting one for a report), run `run` on its DSN,
    and turn refusals into a message and an exit status (2: bad input, 1: else)."""
    url = (settings.reporting_database_url if reporting else None) or settings.database_url
    with open_database(url, settings.data_dir) as db:
        try:
            return asyncio.run(run(db.dsn))
        except (InvalidRequest, UnknownTenant, UnknownReport, UnknownName, CellsError) as exc:
            print(f"llmquota: error: {exc}", file=sys.stderr)
            return 2
        except LimiterError as exc:
            print(f"llmquota: error: {exc}", file=sys.stderr)
            return 1
        except DatabaseError as exc:
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

    async def export(connection: Connection) -> int:
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

    async def adjust(connection: Connection) -> int:
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

    return _run_on_connection(settings, adjust, tenant=args.tenant)


def cmd_prices_set(args: argparse.Namespace, settings: Settings) -> int:
    """Set a model's prices per million tokens from a date on."""
    from llmquota.finance.ledger import LedgerStore, parse_effective_from, parse_price

    async def set_price(connection: Connection) -> int:
        price, superseded = await LedgerStore(connection).set_price(
            model=args.model,
            input_usd_per_million=parse_price("--input-per-million", args.input_per_million),
            output_usd_per_million=parse_price("--output-per-million", args.output_per_million),
            # An empty value (flag or variable) is an error, not "now". In a
            # database of cells, "now" is each cell's clock as the price reaches it.
            effective_from=(
                None if args.effective_from is None else parse_effective_from(args.effective_from)
            ),
            set_by=args.set_by,
            backdate_reason=args.backdate,
        )
        verb = "superseded" if superseded else "set"
        backdated = f" (backdated: {price.backdate_reason})" if price.backdate_reason else ""
        _print_line(
            f"{verb}: {price.model} from {price.effective_from.isoformat()}: "
            f"input {price.input_usd_per_million} USD, output {price.output_usd_per_million} "
            f"USD per million tokens, by {price.set_by}{backdated}"
        )
        return 0

    return _run_on_connection(settings, set_price, cells="every")


def cmd_prices_import(args: argparse.Namespace, settings: Settings) -> int:
    """Import the price table shipped with llmquota; say what each row did."""
    from llmquota.finance.builtin_prices import OUTCOMES, import_builtin_prices, load_builtin_prices
    from llmquota.finance.ledger import LedgerStore

    if not args.builtin:
        print("llmquota: error: say what to import: --builtin", file=sys.stderr)
        return 2
    try:
        table = load_builtin_prices()
    except InvalidRequest as exc:  # a broken package, not the operator's input
        print(f"llmquota: error: the builtin price table: {exc}", file=sys.stderr)
        return 1

    async def import_prices(connection: Connection) -> int:
        done = await import_builtin_prices(LedgerStore(connection), table)
        for row in done:
            if row.outcome in ("added", "operator"):
                _print_line(
                    f"{row.outcome}: {row.model} from {row.effective_from.date().isoformat()}"
                    f" (table: {row.declared_from.date().isoformat()})"
                )
        counts = {outcome: sum(r.outcome == outcome for r in done) for outcome in OUTCOMES}
        _print_line(
            f"builtin prices: {len(done)} rows: "
            + ", ".join(f"{outcome} {n}" for outcome, n in counts.items())
        )
        return 0

    return _run_on_connection(settings, import_prices, cells="every")


def cmd_prices_list(args: argparse.Namespace, settings: Settings) -> int:
    """Show model prices."""
    from llmquota.cli.tabular import render
    from llmquota.finance.ledger import LedgerStore

    async def list_prices(connection: Connection) -> int:
        prices = await LedgerStore(connection).prices(args.model)
        columns = (
            "model",
            "effective_from",
            "input_usd_per_million",
            "output_usd_per_million",
            "set_at",
            "set_by",
            "backdate_reason",
        )
        rows = [
            (
                p.model,
                p.effective_from,
                p.input_usd_per_million,
                p.output_usd_per_million,
                p.set_at,
                p.set_by,
                p.backdate_reason,
            )
            for p in prices
        ]
        sys.stdout.write(render(columns, rows, args.format))
        return 0

    return _run_on_connection(settings, list_prices, cells="first")


def cmd_report(args: argparse.Namespace, settings: Settings) -> int:
    """Run a finance report (a function of the reporting schema), or list them."""
    from llmquota.cli.oversubscription import (
        OVERSUBSCRIPTION,
        OVERSUBSCRIPTION_DESCRIPTION,
        report_oversubscription,
    )
    from llmquota.cli.tabular import render
    from llmquota.finance.cell_reports import merge_cell_reports
    from llmquota.finance.reports import ReportResult, ReportStore, normalize_name, parse_period

    if not args.list and not args.name:
        print("llmquota: error: name a report, or use --list", file=sys.stderr)
        return 2
    if not args.list and normalize_name(args.name) == OVERSUBSCRIPTION:
        return report_oversubscription(args, settings)
    if not args.list and (args.days is not None or args.ceiling is not None):
        print(
            f"llmquota: error: --days and --ceiling are the {OVERSUBSCRIPTION} report's; "
            "the others cover --from to --to",
            file=sys.stderr,
        )
        return 2
    if not args.list:
        try:
            start, end = parse_period(args.date_from, args.date_to)
        except InvalidRequest as exc:
            print(f"llmquota: error: {exc}", file=sys.stderr)
            return 2

    async def list_reports(connection: Connection) -> int:
        listing = [(r.name, r.description) for r in await ReportStore(connection).list_reports()]
        listing.append((OVERSUBSCRIPTION, OVERSUBSCRIPTION_DESCRIPTION))
        listing.sort()
        sys.stdout.write(render(("report", "description"), listing, args.format))
        return 0

    if args.list:
        return _run_on_connection(settings, list_reports, reporting=True, cells="first")
    results: list[ReportResult] = []

    async def report(connection: Connection) -> int:
        results.append(await ReportStore(connection).run(args.name, start, end, args.tenant))
        return 0

    # In a database of cells, each cell's (or the one --tenant lives in), merged.
    status = _run_on_connection(settings, report, reporting=True, cells="every", tenant=args.tenant)
    if status != 0:
        return status
    try:
        result = (
            results[0]
            if len(results) == 1
            else merge_cell_reports(normalize_name(args.name), results)
        )
    except InvalidRequest as exc:
        print(f"llmquota: error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(render(result.columns, result.rows, args.format))
    return 0


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
    add_flag(export, "ledger export", "--after-id", type=ascii_integer, metavar="N")
    add_flag(export, "ledger export", "--limit", type=ascii_integer, metavar="N")
    export.set_defaults(func=cmd_ledger_export)

    adjust = actions.add_parser(
        "adjust",
        help="append a signed correction (the ledger is never edited)",
        description="Append an adjustment row: signed tokens for a tenant, with a reason.",
    )
    add_flag(adjust, "ledger adjust", "--tenant", required=True)
    add_flag(adjust, "ledger adjust", "--tokens", required=True, type=ascii_integer)
    add_flag(adjust, "ledger adjust", "--reason", required=True)
    add_flag(adjust, "ledger adjust", "--model")
    add_flag(adjust, "ledger adjust", "--route")
    add_flag(adjust, "ledger adjust", "--token-type", choices=TOKEN_TYPES)
    adjust.set_defaults(func=cmd_ledger_adjust)


def _add_price_commands(commands: Any) -> None:
    from llmquota.cli.tabular import FORMATS

    prices = commands.add_parser("prices", help="model prices per million tokens")
    actions = prices.add_subparsers(dest="prices_command", required=True)
    set_ = actions.add_parser(
        "set",
        help="add a version of a model's prices from a date on",
        description="Reports cost usage at the price in force when it was recorded. Prices "
        "are append-only versions; a model is a name or a * glob (the exact name wins, then "
        "the longest glob). A price taking effect in the past needs --backdate REASON, and "
        "never reaches into a closed month.",
    )
    add_flag(set_, "prices set", "--model", required=True)
    add_flag(set_, "prices set", "--input-per-million", required=True, metavar="USD")
    add_flag(set_, "prices set", "--output-per-million", required=True, metavar="USD")
    add_flag(set_, "prices set", "--effective-from", metavar="DATE")
    add_flag(set_, "prices set", "--set-by", required=True, metavar="WHO")
    add_flag(set_, "prices set", "--backdate", metavar="REASON")
    set_.set_defaults(func=cmd_prices_set)

    import_ = actions.add_parser(
        "import",
        help="import the price table shipped with llmquota (--builtin)",
        description="Add the shipped prices (OpenAI, Anthropic, Google; USD per million "
        "tokens, each in force from its date, never before this month) as versions set by "
        "'llmquota builtin'. A model you priced yourself (by its name or a glob matching it) "
        "is left alone, and a row whose prices are already in force adds nothing: importing "
        "again changes nothing.",
    )
    import_.add_argument("--builtin", action="store_true", help="the table shipped in the package")
    import_.set_defaults(func=cmd_prices_import)

    list_ = actions.add_parser("list", help="show every version of the prices")
    add_flag(list_, "prices list", "--model")
    add_flag(list_, "prices list", "--format", choices=FORMATS)
    list_.set_defaults(func=cmd_prices_list)


def _add_report_command(commands: Any) -> None:
    from llmquota.cli.tabular import FORMATS

    report = commands.add_parser(
        "report",
        help="run a finance report (the SQL of the reporting schema)",
        description="Run a report function of the reporting schema over [--from, --to) in "
        "UTC days, or `oversubscription`: every provider ceiling (or --ceiling's) over the "
        "last --days days (default 7) up to now, judged by LLMQUOTA_OVERSUBSCRIPTION_WARN_RATIO "
        "and _CRITICAL_RATIO. The database is LLMQUOTA_REPORTING_DATABASE_URL when set (e.g. "
        "as the read-only llmquota_reporting role), else LLMQUOTA_DATABASE_URL.",
    )
    report.add_argument(
        "name", nargs="?", help="report name, e.g. usage_daily or oversubscription (see --list)"
    )
    report.add_argument("--list", action="store_true", help="list the reports that exist")
    add_flag(report, "report", "--from", dest="date_from", metavar="DATE")
    add_flag(report, "report", "--to", dest="date_to", metavar="DATE")
    add_flag(report, "report", "--tenant")
    add_flag(report, "report", "--days", type=ascii_integer, metavar="N")
    add_flag(report, "report", "--ceiling")
    add_flag(report, "report", "--format", choices=FORMATS)
    report.set_defaults(func=cmd_report)


def add_finance_commands(commands: Any) -> None:
    """`ledger`, `prices` and `report`."""
    _add_ledger_commands(commands)
    _add_price_commands(commands)
    _add_report_command(commands)
