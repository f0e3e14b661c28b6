"""`llmquota keys list|create|revoke|rotate|policy`: the key lifecycle from a shell.

The same rules as the API (admin/keys.py decides), straight on the database:
for the operator who has no admin key at hand, or lost it. `--tenant NAME`
acts on a tenant's keys, `--admin` on the admin keys stored in the database.
Output: a table, or `--json`; nothing else is printed on success. The key's
secret is printed once, by create and rotate. A tenant key's own limits
(`--tokens-per-minute`, `--requests-per-minute`, `--max-in-flight`,
`--models`, ...) are set by create and replaced by `policy`. These flags have no
LLMQUOTA_* fallback: a key's parameters are the operator's choice each time.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from llmquota.cli.options import ascii_integer
from llmquota.cli.tabular import Format, render
from llmquota.config import Settings
from llmquota.domain.errors import InvalidRequest, NameInUse, UnknownName, UnknownTenant
from llmquota.domain.key_limits import KeyLimits
from llmquota.domain.keys import IssuedKey, KeyRecord
from llmquota.store.database import open_database

if TYPE_CHECKING:
    from llmquota.admin.keys import KeyService

# Records to list, or a key just issued.
Outcome = tuple[list[KeyRecord], IssuedKey | None]

COLUMNS: tuple[str, ...] = ("id", "tenant", "prefix", "label", "scopes", "created_at")
COLUMNS += ("last_used_at", "expires_at", "revoked_at")
COLUMNS += ("tokens_per_minute", "requests_per_minute", "max_in_flight", "models")
# The flags of a key's own limits, as KeyLimits names them.
LIMIT_FLAGS: tuple[str, ...] = ("tokens_per_minute", "token_burst", "requests_per_minute")
LIMIT_FLAGS += ("request_burst", "max_in_flight")
# What `llmquota keys` refuses with exit status 2 and one line on stderr.
_REFUSALS = (InvalidRequest, NameInUse, UnknownName, UnknownTenant)


def _row(record: KeyRecord) -> tuple[Any, ...]:
    return (
        record.key_id,
        record.tenant,
        record.prefix,
        record.label,
        ",".join(record.scopes),
        record.created_at,
        record.last_used_at,
        record.expires_at,
        record.revoked_at,
        record.limits.tokens_per_minute,
        record.limits.requests_per_minute,
        record.limits.max_in_flight,
        None if record.limits.models is None else ",".join(record.limits.models),
    )


def _limits(args: argparse.Namespace) -> KeyLimits:
    """The limit flags as KeyLimits; InvalidRequest naming the flag that is wrong."""
    fields: dict[str, Any] = {name: getattr(args, name) for name in LIMIT_FLAGS}
    if args.models is not None:
        fields["models"] = [m.strip() for m in args.models.split(",")]
    try:
        return KeyLimits(**{k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        first = exc.errors()[0]
        message = str(first["msg"]).removeprefix("Value error, ")
        if first["loc"]:
            message = f"{first['loc'][0]}: {message}"
        for name in (*LIMIT_FLAGS, "models"):  # as the flags are spelled
            message = message.replace(name, "--" + name.replace("_", "-"))
        raise InvalidRequest(message) from None


def _print(records: list[KeyRecord], issued: IssuedKey | None, args: argparse.Namespace) -> None:
    fmt: Format = "json" if args.json else "table"
    if issued is None:
        sys.stdout.write(render(COLUMNS, [_row(r) for r in records], fmt))
        return
    # Shown once: the secret first, then the key's fields.
    sys.stdout.write(render(("key", *COLUMNS), [(issued.key, *_row(issued.record))], fmt))


async def _run(dsn: str, settings: Settings, act: Callable[[Any], Awaitable[Any]]) -> Any:
    from llmquota.admin.keys import KeyService
    from llmquota.store.store import Store

    store = await Store.connect(
        dsn, min_size=1, max_size=1, transaction_pooler=settings.transaction_pooler
    )
    try:
        service = KeyService(
            store,
            deadline_seconds=settings.statement_timeout_ms / 1000.0,
            admin_elsewhere=bool(settings.admin_key),
        )
        return await act(service)
    finally:
        await store.close()


def _action(args: argparse.Namespace) -> Callable[[KeyService], Awaitable[Outcome]]:
    """What the subcommand does with a KeyService; (records, issued) it returns."""
    tenant = None if getattr(args, "admin", False) else args.tenant

    async def act(keys: KeyService) -> Outcome:
        if args.action == "create":
            scopes = [s.strip() for s in args.scopes.split(",")] if args.scopes else None
            options: dict[str, Any] = {"label": args.label, "expires_at": args.expires_at}
            options["limits"] = _limits(args)
            if scopes is not None:
                if tenant is None:
                    raise InvalidRequest("--scopes: admin keys have no scopes")
                options["scopes"] = scopes
            return [], await keys.create(tenant, **options)
        if args.action == "rotate":
            return [], await keys.rotate(tenant, args.id, args.grace_seconds)
        if args.action == "policy":
            await keys.set_limits(args.tenant, args.id, _limits(args))
            return [r for r in await keys.list(args.tenant) if r.key_id == args.id], None
        if args.action == "revoke":
            await keys.revoke(tenant, args.id)
            return [r for r in await keys.list(tenant) if r.key_id == args.id], None
        return await keys.list(tenant), None

    return act


def cmd_keys(args: argparse.Namespace, settings: Settings) -> int:
    """Run one `keys` subcommand and print its result."""
    with open_database(settings.database_url, settings.data_dir) as db:
        try:
            records, issued = asyncio.run(_run(db.dsn, settings, _action(args)))
        except _REFUSALS as exc:
            print(f"llmquota: error: {exc}", file=sys.stderr)
            return 2
    _print(records, issued, args)
    return 0


def _iso_time(text: str) -> datetime:
    """argparse `type` for --expires-at: ISO 8601; without an offset, UTC (as the API)."""
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an ISO 8601 time") from None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def _owner(parser: argparse.ArgumentParser) -> None:
    whose = parser.add_mutually_exclusive_group(required=True)
    whose.add_argument("--tenant", help="the tenant whose keys these are")
    whose.add_argument("--admin", action="store_true", help="the admin keys")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _limit_options(parser: argparse.ArgumentParser) -> None:
    """The key's own limits (a tenant key's only), decided with its tenant's."""
    for name in LIMIT_FLAGS:
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, type=ascii_integer, help=f"the key's own {name} (default: none)")
    parser.add_argument(
        "--models", help="comma-separated model names and * globs the key may use (default: any)"
    )


def add_keys_command(commands: Any) -> None:
    """`keys list|create|revoke|rotate|policy`."""
    keys = commands.add_parser(
        "keys", help="list, create, revoke or rotate API keys, or set a key's own limits"
    )
    actions = keys.add_subparsers(dest="action", required=True)
    listing = actions.add_parser("list", help="the keys (revoked ones too); never a secret")
    _owner(listing)
    create = actions.add_parser("create", help="issue a key; its secret is printed once")
    _owner(create)
    create.add_argument("--label", help="what the key is for")
    create.add_argument("--expires-at", type=_iso_time, help="ISO 8601 time, in the future")
    create.add_argument("--scopes", help="comma-separated subset of admit,read (default both)")
    _limit_options(create)
    policy = actions.add_parser(
        "policy", help="replace a tenant key's own limits (a flag left out: not limited)"
    )
    policy.add_argument("--tenant", required=True, help="the tenant whose key this is")
    policy.add_argument("--json", action="store_true", help="print JSON instead of a table")
    policy.add_argument("id", type=ascii_integer, help="the key's id")
    _limit_options(policy)
    revoke = actions.add_parser("revoke", help="refuse the key from now on")
    _owner(revoke)
    revoke.add_argument("id", type=ascii_integer, help="the key's id")
    rotate = actions.add_parser("rotate", help="a new secret for the key, printed once")
    _owner(rotate)
    rotate.add_argument("id", type=ascii_integer, help="the key's id")
    rotate.add_argument(
        "--grace-seconds", type=ascii_integer, default=0, help="how long the old secret works"
    )
    keys.set_defaults(func=cmd_keys)
