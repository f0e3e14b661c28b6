"""What the database announces when keys and tenants change (migrations 0014, 0018):
every digest a worker may have cached, and the tenant of a suspension."""

from __future__ import annotations

import asyncio
import contextlib

import asyncpg
import pytest

from llmquota.admin.keys import KeyService
from llmquota.domain.keys import key_digest
from llmquota.store import listener as listener_module
from llmquota.store.listener import ChangeListener
from llmquota.store.store import Store


async def test_rotations_revocation_and_suspension_announce_every_cached_digest(
    app_dsn: str, db: asyncpg.Connection
) -> None:
    heard: asyncio.Queue[str] = asyncio.Queue()
    await db.add_listener("llmquota_changes", lambda *args: heard.put_nowait(args[3]))
    store = await Store.connect(app_dsn, min_size=1, max_size=1)
    keys = KeyService(store, deadline_seconds=10, admin_elsewhere=False)

    async def announced(expected: set[str]) -> set[str]:
        """What was announced: `expected` as soon as it has all come (10 s at
        most: a loaded machine delivers late), and whatever else came with it."""
        found: set[str] = set()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while not expected <= found and loop.time() < deadline:
            with contextlib.suppress(TimeoutError):
                found.add(await asyncio.wait_for(heard.get(), deadline - loop.time()))
        await asyncio.sleep(0.2)  # an announcement too many would be here by now
        while not heard.empty():
            found.add(heard.get_nowait())
        return found

    def named(*secrets: str) -> set[str]:
        return {f"api_keys:{key_digest(secret).hex()}" for secret in secrets}

    try:
        first = await keys.create("acme")
        assert named(first.key) <= await announced(named(first.key))
        key_id = first.record.key_id
        second = await keys.rotate("acme", key_id, grace_seconds=60)
        assert await announced(named(first.key, second.key)) == named(first.key, second.key)
        # Rotating again in the grace: the first secret ends, and is announced.
        third = await keys.rotate("acme", key_id, grace_seconds=60)
        expected = named(first.key, second.key, third.key)
        assert await announced(expected) == expected
        assert (await keys.find(key_digest(first.key))) is None
        assert (await keys.find(key_digest(second.key))) is not None
        # Revoking announces the current and the previous secret.
        await keys.revoke("acme", key_id)
        assert await announced(named(second.key, third.key)) == named(second.key, third.key)
        assert await keys.find(key_digest(second.key)) is None
        assert await keys.find(key_digest(third.key)) is None
        await keys.suspend("acme", True)
        assert await announced({"tenants:acme"}) == {"tenants:acme"}
        await keys.suspend("acme", True)  # already suspended: nothing changes
        assert await announced(set()) == set()
        await keys.suspend("acme", False)
        assert await announced({"tenants:acme"}) == {"tenants:acme"}
    finally:
        await store.close()


async def test_a_listener_that_loses_its_session_while_finding_its_cell_leaves_none_open(
    app_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The listener asks where the DSN's cell lives before it listens; a server
    # that dies at that moment (a failover) must not leave that session open.
    asked: list[asyncpg.Connection] = []

    async def dies(connection: asyncpg.Connection) -> None:
        asked.append(connection)
        raise ConnectionResetError("the primary went away")

    monkeypatch.setattr(listener_module, "node_of_this_cell", dies)
    listener = ChangeListener(app_dsn, lambda _payload: None)
    with pytest.raises(ConnectionResetError):
        await listener._listen_once()
    assert len(asked) == 1 and asked[0].is_closed()
