"""`llmquota serve` and `llmquota migrate`: the service and its schema."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import Any

from llmquota.cli.options import add_converted_flag, add_flag, ascii_integer, is_one
from llmquota.config import Settings, export_for_workers
from llmquota.store.database import open_database
from llmquota.store.lock_patience import LockPatience

log = logging.getLogger(__name__)


def cmd_migrate(args: argparse.Namespace, settings: Settings) -> int:
    """Apply the versioned migrations, then the repeatable scripts that changed."""
    from llmquota.store import migrate

    if args.cells is not None:
        return _migrate_cells(args.cells, settings)
    with open_database(settings.database_url, settings.data_dir) as db:
        try:
            applied = migrate.upgrade(db.dsn, patience=lock_patience(settings))
        except (migrate.MigrationRefused, migrate.MigrationLocksUnavailable) as refused:
            print(f"llmquota migrate: {refused}", file=sys.stderr)
            return 2
    for script in applied:
        print(script.describe())
    if not applied:
        print("functions up to date")
    print("database is at the latest schema")
    return 0


def lock_patience(settings: Settings) -> LockPatience:
    """How long migrating waits for table locks, as the settings say."""
    return LockPatience(settings.migrate_lock_timeout_ms, settings.migrate_lock_attempts)


def _migrate_cells(count: int, settings: Settings) -> int:
    """`migrate --cells K`: a database of K cells (store/cells.py; docs/scaling.md)."""
    from llmquota.store.cells import CellsError, build_cells
    from llmquota.store.lock_patience import MigrationLocksUnavailable

    with open_database(settings.database_url, settings.data_dir) as db:
        try:
            cells = build_cells(db.dsn, count, lock_patience(settings))
        except (CellsError, MigrationLocksUnavailable) as error:
            print(f"llmquota migrate: {error}", file=sys.stderr)
            return 2
    for cell in cells:
        print(f"{cell.name}: {cell.status}" + (f", on {cell.node}" if cell.node else ""))
    print(f"database holds {len(cells)} cells at the latest schema")
    return 0


async def _ensure_admin_key(dsn: str, settings: Settings) -> str | None:
    """Create and return an admin key on first start, when none is configured.

    With LLMQUOTA_ADMIN_KEY set, the admin keys stored in the database (the one
    generated at first start among them) keep working beside it until revoked:
    say so, by id, so that the operator can revoke them.
    """
    from llmquota.admin.service import AdminService

    admin = await AdminService.connect(dsn, transaction_pooler=settings.transaction_pooler)
    try:
        if not settings.admin_key:
            return await admin.ensure_first_admin_key()
        stored = [k.key_id for k in await admin.keys.list(None) if k.revoked_at is None]
    finally:
        await admin.close()
    if stored:
        log.warning(
            "LLMQUOTA_ADMIN_KEY is set, and %d admin key(s) stored in the database still "
            "work beside it (ids %s): revoke them with `llmquota keys revoke --admin ID`",
            len(stored),
            ", ".join(map(str, stored)),
        )
    return None


_PROXY_PATHS = {
    "openai": "/v1/chat/completions, /v1/completions, /v1/embeddings",
    "anthropic": "/v1/messages",
}


def _proxy_lines(settings: Settings) -> list[str]:
    """Which provider endpoints this server proxies, and where to (never the key)."""
    return [
        f"proxy: POST {_PROXY_PATHS[u.format]} -> {u.base_url} ({u.name}: {', '.join(u.models)})"
        for u in settings.upstreams()
    ]


def _cells_to_serve(dsn: str, args: argparse.Namespace, settings: Settings) -> list[str] | None:
    """The cells a service at `dsn` serves (none: a database without cells, or
    one cell's DSN), or None after saying why it cannot serve them."""
    from llmquota.store.cells import CellsError, cells_served_at

    try:
        cells = asyncio.run(cells_served_at(dsn))
    except CellsError as error:
        print(f"llmquota serve: {error}", file=sys.stderr)
        return None
    refusal = None
    if cells and args.migrate:
        refusal = f"`llmquota migrate --cells {len(cells)}` builds and checks them"
    elif cells and not settings.admin_key:
        refusal = "set LLMQUOTA_ADMIN_KEY (an admin key stored in the database lives in one cell)"
    if refusal is not None:
        print(f"llmquota serve: the database holds {len(cells)} cells: {refusal}", file=sys.stderr)
        return None
    return cells


def cmd_serve(args: argparse.Namespace, settings: Settings) -> int:
    """Run the REST API (migrating an embedded database first)."""
    import uvicorn

    from llmquota.api.protocols import http_protocol_class
    from llmquota.store import migrate

    with open_database(settings.database_url, settings.data_dir) as db:
        cells = _cells_to_serve(db.dsn, args, settings)
        if cells is None:
            return 2
        if (db.embedded or args.migrate) and not cells:
            try:
                migrate.upgrade(db.dsn, patience=lock_patience(settings))
            except (migrate.MigrationRefused, migrate.MigrationLocksUnavailable) as refused:
                print(f"llmquota serve: {refused}", file=sys.stderr)
                return 2
        generated = None if cells else asyncio.run(_ensure_admin_key(db.dsn, settings))
        if cells:
            print(f"serving {len(cells)} cells: {', '.join(cells)}", flush=True)
        if generated:
            print(
                "Generated the admin API key. It is shown once; store it now:\n"
                f"  {generated}\n"
                "(Set LLMQUOTA_ADMIN_KEY to use a key of your own.)",
                flush=True,
            )
        for line in _proxy_lines(settings):
            print(line, flush=True)
        # Workers are separate processes: they read the resolved DSN from the environment.
        export_for_workers(db.dsn, (args.host, args.port))
        uvicorn.run(
            # over cells, a front sends each request to its cell's service
            "llmquota.api.cells_front:create_front_from_env"
            if cells
            else "llmquota.api.app:create_app_from_env",
            factory=True,
            host=args.host,
            port=args.port,
            workers=args.workers,
            log_level=args.log_level,
            access_log=args.access_log,
            # uvicorn's own parser choice, with limits on each request head.
            http=http_protocol_class(),
        )
    return 0


def add_service_commands(commands: Any) -> None:
    """`serve` and `migrate`."""
    serve = commands.add_parser("serve", help="run the REST API")
    add_flag(serve, "serve", "--host")
    add_converted_flag(serve, "serve", "--port", ascii_integer, type=ascii_integer)
    add_converted_flag(serve, "serve", "--workers", ascii_integer, type=ascii_integer)
    add_converted_flag(serve, "serve", "--migrate", is_one, action="store_true")
    add_flag(serve, "serve", "--log-level")
    add_converted_flag(serve, "serve", "--access-log", is_one, action="store_true")
    serve.set_defaults(func=cmd_serve)

    migrate = commands.add_parser("migrate", help="apply database migrations")
    migrate.add_argument(
        "--cells",
        type=ascii_integer,
        metavar="K",
        help="build K cells (schemas cell_1 ... cell_K) in a database of their own; "
        "on Citus each is a distributed schema on one node (docs/scaling.md)",
    )
    migrate.set_defaults(func=cmd_migrate)
