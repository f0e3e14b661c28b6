"""Announced changes, applied to this worker's caches as they commit.

The database announces every change of what workers cache (store/listener.py
says how, migrations/versions/0014 what): policies, plans and ceilings reach
the policy cache, which reloads at once (the estimates read their strategy
from it), and keys reach whoever watches them (the API's key cache). A
LISTEN needs a session of its own on the server itself, so behind a
transaction pooler only `listen_database_url` (a direct DSN) makes one; with
none, the periodic refreshes alone apply changes, as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from llmquota.config import Settings
from llmquota.store.listener import ChangeListener

log = logging.getLogger(__name__)


class ChangeFeed:
    """One worker's listener, and what each announcement changes."""

    def __init__(self, settings: Settings, policies_changed: Callable[[], None]) -> None:
        self._settings = settings
        self._policies_changed = policies_changed
        self.listener: ChangeListener | None = None
        # Who else caches what announcements name (the API's key cache).
        self._key_watchers: list[Callable[[bytes | None], None]] = []
        # Who caches a tenant's suspension (the key cache, with its keys).
        self._tenant_watchers: list[Callable[[str], None]] = []

    def listen(self, dsn: str | None) -> None:
        """Start listening over a direct connection to `dsn` (or
        settings.listen_database_url), once; never through a transaction pooler."""
        settings = self._settings
        if self.listener is not None or not settings.change_notifications:
            return
        target = settings.listen_database_url or (None if settings.transaction_pooler else dsn)
        if target is None:
            log.info("no direct DSN to LISTEN on: changes apply at the periodic refreshes")
            return
        self.listener = ChangeListener(target, self.changed)
        self.listener.start()

    def watch_keys(self, dropped: Callable[[bytes | None], None]) -> None:
        """Call `dropped(digest)` when a key's row changes, `dropped(None)` when
        any may have (the listener started again after losing its session)."""
        self._key_watchers.append(dropped)

    def watch_tenants(self, changed: Callable[[str], None]) -> None:
        """Call `changed(tenant)` when a tenant is suspended or resumed (0018)."""
        self._tenant_watchers.append(changed)

    def changed(self, payload: str | None) -> None:
        """One announcement: a table's name, `api_keys:<hex digest>` or
        `tenants:<name>`; None: anything."""
        shard_or_table, _, detail = (payload or "").partition(":")
        table = _table_of(shard_or_table)
        if payload is None or table == "api_keys":
            digest = bytes.fromhex(detail) if detail else None
            for dropped in self._key_watchers:
                dropped(digest)
        if table == "tenants":
            for changed in self._tenant_watchers:
                changed(detail)
        if payload is None or table not in {"api_keys", "tenants"}:
            self._policies_changed()

    async def close(self) -> None:
        if self.listener is not None:
            await self.listener.close()
            self.listener = None


def _table_of(announced: str) -> str:
    """The table an announcement names. On a Citus worker (a cell of
    `llmquota migrate --cells`) the trigger fires on the table's shard, whose
    name is the table's with `_<shard id>` appended."""
    table, underscore, shard_id = announced.rpartition("_")
    return table if underscore and shard_id.isdigit() else announced
