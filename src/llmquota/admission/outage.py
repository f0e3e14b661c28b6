"""The outage journal: what a worker admitted on its own, until the store has it.

During a store outage a worker may admit requests itself (failure modes open
and local). Each such reservation gets a reservation id the worker makes (a
version-8 UUID, so any worker can tell it from PostgreSQL's version-4 ids)
and an entry here, as do its settle or release. When the store answers
again, `flush` writes the admissions (lq_record_outage_admissions) and then
their settlements (lq_finish_outage), in batches, and forgets each entry once
the store holds everything about it. Each entry carries the worker's wall
clock at its admission and at its settle, so the store bills the usage to
the quota windows it happened in, not to the moment of the replay. A
settlement of a reservation the store already holds, whose statement the
store did not answer (a proxied answer relayed during an outage: its usage
must not be lost), is journaled too (`add_settlement`) and replayed first.
All these statements are idempotent on the reservation id, so a flush
repeated after a lost answer, a crash or a spool replayed by another worker
records nothing twice.

The journal is bounded (`max_entries`): when it is full the worker stops
admitting on its own, because it could not count what it admitted. With a
spool directory each change is also appended to a file and fsync'd before
the caller hears yes, so a worker killed mid-outage loses nothing: the next
worker to start on the same directory adopts the dead one's file (it can
take the file's lock only once the owner is gone) and flushes it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import secrets
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, Any

from llmquota.domain.errors import LimiterError
from llmquota.domain.records import AdmitRequest, FinishRequest, OutageAdmissionRecord
from llmquota.domain.vocabulary import FailureMode
from llmquota.store.store import Store

log = logging.getLogger(__name__)

SPOOL_GLOB = "spool-*.jsonl"


class JournalFull(LimiterError):
    """The journal holds as many entries as it may; nothing more can be admitted locally."""


@dataclass(slots=True)
class OutageEntry:
    """One reservation admitted during an outage, and what happened to it since."""

    reservation_id: uuid.UUID
    request: AdmitRequest
    mode: FailureMode
    policy_version: int
    finish: FinishRequest | None = None
    recorded: bool = False
    # The worker's wall clock (UTC) at the admission and at the settle or
    # release: when the usage happened. None in a spool written without them.
    admitted_at: datetime | None = None
    finished_at: datetime | None = None

    @property
    def reserved_tokens(self) -> int:
        return self.request.input_tokens + self.request.max_tokens

    @property
    def tenant(self) -> str:
        return self.request.tenant


@dataclass(frozen=True, slots=True)
class FlushReport:
    """What one flush wrote and which entries it forgot."""

    admissions_recorded: int
    finishes_recorded: int
    forgotten: list[OutageEntry]


# Owner only: the spool is the worker's, and its adopter runs as the same user.
SPOOL_DIRECTORY_MODE = 0o700
SPOOL_FILE_MODE = 0o600


class Spool:
    """An append-only, fsync'd file of journal changes, locked by its owner.

    The journal holds tenants' requests (models, counts, idempotency keys):
    the directory is made 0700 and each file 0600, whatever the umask, so
    no other account on the host reads them."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(mode=SPOOL_DIRECTORY_MODE, parents=True, exist_ok=True)
        directory.chmod(SPOOL_DIRECTORY_MODE)  # an existing one, or one the umask widened
        self.directory = directory
        self.path = directory / f"spool-{os.getpid()}-{secrets.token_hex(4)}.jsonl"
        descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, SPOOL_FILE_MODE)
        os.fchmod(descriptor, SPOOL_FILE_MODE)
        self._file: IO[str] = os.fdopen(descriptor, "a+", encoding="utf-8")
        fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)

    def append(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def truncate(self) -> None:
        """Everything in the file is in the store: start it afresh."""
        self._file.seek(0)
        self._file.truncate()
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self, remove: bool) -> None:
        self._file.close()
        if remove:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    def orphans(self) -> list[list[dict[str, Any]]]:
        """Take over the files of workers that are gone: their records, file by file."""
        taken: list[list[dict[str, Any]]] = []
        for path in sorted(self.directory.glob(SPOOL_GLOB)):
            if path == self.path:
                continue
            try:
                handle = path.open("r", encoding="utf-8")
            except FileNotFoundError:
                continue
            with handle:
                try:
                    fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # its worker is alive
                records = [json.loads(line) for line in handle if line.strip()]
                taken.append(records)
                path.unlink()
        return taken


def _admit_record(entry: OutageEntry) -> dict[str, Any]:
    return {
        "op": "admit",
        "id": str(entry.reservation_id),
        "mode": entry.mode,
        "policy_version": entry.policy_version,
        "request": entry.request._asdict(),
        "at": _instant(entry.admitted_at),
    }


def _finish_of(record: dict[str, Any]) -> FinishRequest:
    fields = dict(record["finish"])
    fields["reservation_id"] = uuid.UUID(record["id"])
    return FinishRequest(**fields)


def _finish_record(finish: FinishRequest, at: datetime | None) -> dict[str, Any]:
    record = dataclasses.asdict(finish)
    record["reservation_id"] = str(finish.reservation_id)
    return {"op": "finish", "id": str(finish.reservation_id), "finish": record, "at": _instant(at)}


def _instant(at: datetime | None) -> str | None:
    return None if at is None else at.isoformat()


def _parse_instant(text: str | None) -> datetime | None:
    return None if text is None else datetime.fromisoformat(text)


class OutageJournal:
    """A worker's outage admissions, in memory (and in a spool file when configured)."""

    def __init__(self, max_entries: int, spool_dir: Path | None = None) -> None:
        self.max_entries = max_entries
        self._entries: dict[uuid.UUID, OutageEntry] = {}
        self._keys: dict[tuple[str, str], uuid.UUID] = {}
        # Settlements of reservations the store holds, that it did not answer.
        self._settlements: dict[uuid.UUID, FinishRequest] = {}
        self._spool = Spool(spool_dir) if spool_dir is not None else None
        if self._spool is not None:
            for records in self._spool.orphans():
                self._adopt(records)

    def __len__(self) -> int:
        return len(self._entries) + len(self._settlements)

    def get(self, reservation_id: uuid.UUID) -> OutageEntry | None:
        return self._entries.get(reservation_id)

    def by_idempotency_key(self, tenant: str, key: str) -> OutageEntry | None:
        found = self._keys.get((tenant, key))
        return None if found is None else self._entries.get(found)

    def add(self, entry: OutageEntry) -> None:
        """Journal an admission before the caller hears it was admitted."""
        if len(self._entries) >= self.max_entries:
            raise JournalFull(f"outage journal holds {self.max_entries} entries")
        if self._spool is not None:
            self._spool.append(_admit_record(entry))
        self._entries[entry.reservation_id] = entry
        if entry.request.idempotency_key is not None:
            self._keys[(entry.tenant, entry.request.idempotency_key)] = entry.reservation_id

    def set_finish(
        self, entry: OutageEntry, finish: FinishRequest, at: datetime | None = None
    ) -> None:
        """Journal the settle or release of a journaled reservation, made at `at`."""
        if self._spool is not None:
            self._spool.append(_finish_record(finish, at))
        entry.finish = finish
        entry.finished_at = at

    def add_settlement(self, finish: FinishRequest) -> None:
        """Journal the settle of a reservation the store holds but did not answer for.

        Replayed by `flush` after the admissions, like the settle of an outage
        admission: lq_finish records it once (on time, late if the lease ran
        out meanwhile, or `replayed` if the unanswered statement committed).
        """
        if finish.action != "settle":
            raise ValueError("only a settlement is journaled for a reservation the store holds")
        if finish.reservation_id not in self._settlements and len(self) >= self.max_entries:
            raise JournalFull(f"outage journal holds {self.max_entries} entries")
        self._keep_settlement(finish)

    def _keep_settlement(self, finish: FinishRequest) -> None:
        if self._spool is not None:
            record = _finish_record(finish, None)
            record["op"] = "settle"
            self._spool.append(record)
        self._settlements[finish.reservation_id] = finish

    def _adopt(self, records: Sequence[dict[str, Any]]) -> None:
        """Take a dead worker's entries (copied into our own spool first)."""
        adopted: dict[uuid.UUID, OutageEntry] = {}
        settlements: dict[uuid.UUID, FinishRequest] = {}
        for record in records:
            reservation_id = uuid.UUID(record["id"])
            if record["op"] == "admit":
                adopted[reservation_id] = OutageEntry(
                    reservation_id=reservation_id,
                    request=AdmitRequest(**record["request"]),
                    mode=record["mode"],
                    policy_version=int(record["policy_version"]),
                    admitted_at=_parse_instant(record.get("at")),
                )
            elif record["op"] == "finish" and reservation_id in adopted:
                adopted[reservation_id].finish = _finish_of(record)
                adopted[reservation_id].finished_at = _parse_instant(record.get("at"))
            elif record["op"] == "settle":
                settlements[reservation_id] = _finish_of(record)
            elif record["op"] == "forgotten":
                adopted.pop(reservation_id, None)
                settlements.pop(reservation_id, None)
        for entry in adopted.values():
            if entry.reservation_id in self._entries:
                continue
            finish, entry.finish = entry.finish, None
            self._entries[entry.reservation_id] = entry
            if self._spool is not None:
                self._spool.append(_admit_record(entry))
            if finish is not None:
                self.set_finish(entry, finish, entry.finished_at)
        self._adopt_settlements(settlements.values())
        if adopted or settlements:
            log.warning(
                "adopted %d outage admissions and %d settlements from a stopped worker",
                len(adopted),
                len(settlements),
            )

    def _adopt_settlements(self, settlements: Iterable[FinishRequest]) -> None:
        for finish in settlements:
            if finish.reservation_id not in self._settlements:
                self._keep_settlement(finish)  # adopted whatever the bound: never dropped

    async def flush(
        self, store: Store, batch_size: int, deadline_seconds: float | None
    ) -> FlushReport:
        """Write everything journaled to the store, oldest first; forget what it holds.

        Raises StoreUnavailable when the store stops answering midway; what was
        written stays written and the rest is tried again next time.

        No lock: a settle may journal itself while a batch is in flight. It
        only ever sets `finish` on an entry (in one synchronous step), and an
        entry is forgotten only when the store holds everything it had when
        the batch was sent, so the settle is sent by this flush or the next.
        """
        recorded, settled = 0, await self._flush_settlements(store, batch_size, deadline_seconds)
        forgotten: list[OutageEntry] = []
        while True:
            batch = [e for e in self._entries.values() if not e.recorded][:batch_size]
            if not batch:
                break
            await store.outage.record_admissions(
                [
                    OutageAdmissionRecord(
                        e.reservation_id, e.request, e.policy_version, e.mode, e.admitted_at
                    )
                    for e in batch
                ],
                deadline_seconds=deadline_seconds,
            )
            for entry in batch:
                entry.recorded = True
            recorded += len(batch)
        finished = settled + await self._flush_finishes(
            store, batch_size, deadline_seconds, forgotten
        )
        # Recorded and not finished: the store holds the reservation now, so
        # its settle or release goes to the store like any other. (No await
        # between this check and the forgetting: no settle can slip between.)
        for entry in [e for e in self._entries.values() if e.recorded and e.finish is None]:
            self._forget(entry)
            forgotten.append(entry)
        if self._spool is not None and not len(self):
            self._spool.truncate()
        return FlushReport(recorded, finished, forgotten)

    async def _flush_finishes(
        self,
        store: Store,
        batch_size: int,
        deadline_seconds: float | None,
        forgotten: list[OutageEntry],
    ) -> int:
        """Send the settles and releases of recorded entries, with the moment each
        happened; forget (into `forgotten`) each entry the store now finished."""
        finished = 0
        while True:
            sent = [
                (e, e.finish, e.finished_at)
                for e in self._entries.values()
                if e.recorded and e.finish is not None
            ][:batch_size]
            if not sent:
                break
            results = await store.outage.finish(
                [finish for _, finish, _ in sent if finish is not None],
                [at for _, finish, at in sent if finish is not None],
                deadline_seconds=deadline_seconds,
            )
            for (entry, finish, _), result in zip(sent, results, strict=True):
                if result.status not in ("settled", "released", "replayed"):
                    log.error(
                        "outage %s of %s came back %s",
                        finish.action if finish else "?",
                        entry.reservation_id,
                        result.status,
                    )
                if self._entries.get(entry.reservation_id) is entry:
                    self._forget(entry)
                    forgotten.append(entry)
            finished += len(sent)
        return finished

    async def _flush_settlements(
        self,
        store: Store,
        batch_size: int,
        deadline_seconds: float | None,
    ) -> int:
        """Replay the journaled settlements of reservations the store holds, first
        (they wait for no admission to be recorded)."""
        finished = 0
        while sent := list(self._settlements.values())[:batch_size]:
            results = await store.finish(sent, deadline_seconds=deadline_seconds)
            for finish, result in zip(sent, results, strict=True):
                if result.status not in ("settled", "replayed"):
                    log.error(
                        "journaled settle of %s came back %s (%s)",
                        finish.reservation_id,
                        result.status,
                        result.state,
                    )
                if self._settlements.get(finish.reservation_id) is finish:
                    del self._settlements[finish.reservation_id]
                    if self._spool is not None:
                        self._spool.append({"op": "forgotten", "id": str(finish.reservation_id)})
            finished += len(sent)
        return finished

    def _forget(self, entry: OutageEntry) -> None:
        self._entries.pop(entry.reservation_id, None)
        key = entry.request.idempotency_key
        if key is not None:
            self._keys.pop((entry.tenant, key), None)
        if self._spool is not None:
            self._spool.append({"op": "forgotten", "id": str(entry.reservation_id)})

    def close(self) -> None:
        """Close the spool; the file stays when it still holds unflushed entries."""
        if self._spool is not None:
            self._spool.close(remove=not len(self))
