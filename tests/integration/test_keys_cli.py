"""`llmquota keys list|create|revoke|rotate` as a subprocess on a real database.

Each command prints only its output (a table, or JSON with --json) on stdout;
refusals are one line on stderr with exit status 2 and change nothing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest

from llmquota.config import Settings
from llmquota.domain.keys import key_digest


async def keys(dsn: str, *args: str, admin_key: str | None = None) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMQUOTA_")}
    env["LLMQUOTA_DATABASE_URL"] = dsn
    if admin_key is not None:
        env["LLMQUOTA_ADMIN_KEY"] = admin_key
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "llmquota.cli", "keys", *args),
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await process.communicate()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def keys_json(dsn: str, *args: str, **options: Any) -> list[dict[str, Any]]:
    status, out, err = await keys(dsn, *args, "--json", **options)
    assert status == 0, err
    rows: list[dict[str, Any]] = json.loads(out)  # stdout is the JSON and nothing else
    return rows


async def test_create_list_rotate_revoke_a_tenant_key(app_dsn: str, db: asyncpg.Connection) -> None:
    soon = (datetime.now(UTC) + timedelta(days=1)).isoformat()
    created = await keys_json(
        app_dsn, "create", "--tenant", "acme", "--label", "ci", "--scopes", "read",
        "--expires-at", soon,
    )  # fmt: skip
    assert len(created) == 1
    key = created[0]
    assert key["prefix"] == key["key"][:11] and key["scopes"] == "read" and key["label"] == "ci"
    assert datetime.fromisoformat(key["expires_at"]) == datetime.fromisoformat(soon)
    stored = await db.fetchval("SELECT key_hash FROM api_keys WHERE key_id = $1", key["id"])
    assert stored == key_digest(key["key"])
    status, table, err = await keys(app_dsn, "list", "--tenant", "acme")
    assert status == 0, err
    lines = table.splitlines()
    assert lines[0].split()[:4] == ["id", "tenant", "prefix", "label"]
    assert key["prefix"] in lines[2] and lines[-1] == "(1 row)"
    assert key["key"] not in table
    rotated = await keys_json(
        app_dsn, "rotate", "--tenant", "acme", str(key["id"]), "--grace-seconds", "60"
    )
    assert rotated[0]["id"] == key["id"] and rotated[0]["key"] != key["key"]
    previous = await db.fetchrow(
        "SELECT previous_hash, previous_expires_at - clock_timestamp() AS left FROM api_keys"
    )
    assert previous["previous_hash"] == key_digest(key["key"])
    assert timedelta(seconds=55) < previous["left"] <= timedelta(seconds=60)
    revoked = await keys_json(app_dsn, "revoke", "--tenant", "acme", str(key["id"]))
    assert revoked[0]["revoked_at"] is not None
    again = await keys_json(app_dsn, "revoke", "--tenant", "acme", str(key["id"]))
    assert again[0]["revoked_at"] == revoked[0]["revoked_at"]  # idempotent


async def test_refusals_print_one_line_and_change_nothing(
    app_dsn: str, db: asyncpg.Connection
) -> None:
    past = (datetime.now(UTC) - timedelta(minutes=1)).isoformat()
    cases = [
        (("create", "--tenant", "acme", "--expires-at", past), "expires_at"),
        (("create", "--tenant", "acme", "--scopes", "admit,write"), "scopes"),
        (("create", "--admin", "--scopes", "read"), "scopes"),
        (("revoke", "--tenant", "acme", "12345"), "unknown key 12345"),
        (("rotate", "--tenant", "acme", "1", "--grace-seconds", "604801"), "grace_seconds"),
        (("list", "--tenant", "nobody"), "unknown tenant"),
    ]
    for args, said in cases:
        status, out, err = await keys(app_dsn, *args)
        assert (status, out) == (2, ""), (args, status, out, err)
        assert said in err.splitlines()[-1], (args, err)
    assert await db.fetchval("SELECT count(*) FROM api_keys") == 0
    status, _out, err = await keys(app_dsn, "create", "--tenant", "acme", "--admin")
    assert status == 2 and "not allowed with argument" in err


async def test_admin_keys_keep_one_unless_llmquota_admin_key_is_set(app_dsn: str) -> None:
    first = (await keys_json(app_dsn, "create", "--admin", "--label", "first"))[0]
    assert first["tenant"] is None
    status, out, err = await keys(app_dsn, "revoke", "--admin", str(first["id"]))
    assert (status, out) == (2, "") and "last admin key" in err
    # With LLMQUOTA_ADMIN_KEY configured, the stored one may go.
    revoked = await keys_json(app_dsn, "revoke", "--admin", str(first["id"]), admin_key="lq_x" * 8)
    assert revoked[0]["revoked_at"] is not None
    listed = await keys_json(app_dsn, "list", "--admin")
    assert [row["id"] for row in listed] == [first["id"]]


async def test_serve_names_the_stored_admin_keys_that_work_beside_llmquota_admin_key(
    app_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    from llmquota.cli.service import _ensure_admin_key

    generated = await _ensure_admin_key(app_dsn, Settings(admin_key=None, _env_file=None))  # type: ignore[call-arg]
    assert generated is not None and generated.startswith("lq_")
    configured = Settings(admin_key="lq_" + "x" * 40, _env_file=None)  # type: ignore[call-arg]
    with caplog.at_level(logging.WARNING, logger="llmquota.cli.service"):
        assert await _ensure_admin_key(app_dsn, configured) is None
    [warning] = [r.getMessage() for r in caplog.records]
    assert "1 admin key(s) stored in the database still work beside it (ids 1)" in warning
    caplog.clear()
    await keys_json(app_dsn, "revoke", "--admin", "1", admin_key="lq_" + "x" * 40)
    with caplog.at_level(logging.WARNING, logger="llmquota.cli.service"):
        assert await _ensure_admin_key(app_dsn, configured) is None
    assert caplog.records == []


async def test_a_key_gets_and_changes_its_own_limits(app_dsn: str, db: asyncpg.Connection) -> None:
    created = await keys_json(
        app_dsn, "create", "--tenant", "acme", "--tokens-per-minute", "1000",
        "--max-in-flight", "2", "--models", "gpt-4o-mini,claude-*",
    )  # fmt: skip
    key = created[0]
    assert (key["tokens_per_minute"], key["max_in_flight"]) == (1000, 2)
    assert key["models"] == "gpt-4o-mini,claude-*"
    layer = await db.fetchrow(
        "SELECT tokens_per_minute, token_burst, tokens, max_in_flight, allowed_models"
        " FROM limit_layers WHERE api_key_id = $1",
        key["id"],
    )
    assert tuple(layer) == (1000, 1000, 1000, 2, ["gpt-4o-mini", "claude-%"])
    changed = await keys_json(
        app_dsn, "policy", "--tenant", "acme", str(key["id"]), "--requests-per-minute", "30"
    )
    assert changed[0]["requests_per_minute"] == 30
    assert changed[0]["tokens_per_minute"] is None and changed[0]["models"] is None
    layer = await db.fetchrow(
        "SELECT tokens_per_minute, requests_per_minute, allowed_models FROM limit_layers"
        " WHERE api_key_id = $1",
        key["id"],
    )
    assert tuple(layer) == (None, 30, None)
    # Refused, one line, nothing changed: a burst without its rate, an admin key's limits.
    for args in (
        ("policy", "--tenant", "acme", str(key["id"]), "--token-burst", "5"),
        ("create", "--admin", "--tokens-per-minute", "5"),
        ("policy", "--tenant", "acme", "999999", "--tokens-per-minute", "5"),
    ):
        status, out, err = await keys(app_dsn, *args)
        assert status == 2 and out == "" and len(err.splitlines()) == 1, (args, err)
    _, _, err = await keys(
        app_dsn, "policy", "--tenant", "acme", str(key["id"]), "--token-burst", "5"
    )
    assert err == "llmquota: error: --token-burst needs --tokens-per-minute (the refill rate)\n"
    sql = "SELECT requests_per_minute FROM limit_layers WHERE api_key_id = $1"
    assert await db.fetchval(sql, key["id"]) == 30
    assert await db.fetchval("SELECT count(*) FROM api_keys WHERE tenant IS NULL") == 0
