"""The only code that talks to PostgreSQL.

A thin connector in procrastinate's style: each method runs one named
statement from sql/queries.sql in one round trip and turns rows into typed
records. No decision is made here and no row is read, changed in Python and
written back: the statements do the atomic work. Driver errors that mean
"the database is not answering" become StoreUnavailable.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

import asyncpg

from llmquota.errors import StoreUnavailable
from llmquota.policy import LayerScope, Policy
from llmquota.sqlfiles import queries

AdmitStatus = Literal[
    "admitted", "replayed", "rate_limited", "too_large", "unknown_tenant", "idempotency_conflict"
]
FinishAction = Literal["settle", "release", "expire"]
FinishStatus = Literal[
    "settled", "released", "expired", "replayed", "conflict", "not_found", "not_due"
]


@dataclass(frozen=True, slots=True)
class AdmitRequest:
    """One admission, already counted and validated."""

    tenant: str
    route: str | None
    model: str
    input_tokens: int
    max_tokens: int
    input_estimated: bool
    lease_seconds: int | None
    idempotency_key: str | None
    request_hash: str | None


@dataclass(frozen=True, slots=True)
class TenantFigures:
    """The tenant layer after a decision, for rate-limit headers."""

    tokens_per_minute: int | None
    token_burst: int | None
    tokens: float | None
    requests_per_minute: int | None
    request_burst: int | None
    requests: float | None


@dataclass(frozen=True, slots=True)
class AdmitDecision:
    """What lq_admit decided for one request."""

    status: AdmitStatus
    reservation_id: uuid.UUID | None
    reserved_tokens: int | None
    lease_expires_at: datetime | None
    lease_generation: int | None
    limit_kind: str | None
    limit_scope: str | None
    retry_after_ms: int | None
    capacity: int | None
    remaining_tokens: int | None
    remaining_requests: int | None
    remaining_in_flight: int | None
    tenant: TenantFigures


@dataclass(frozen=True, slots=True)
class FinishRequest:
    """One settle, release or expire."""

    reservation_id: uuid.UUID
    action: FinishAction
    caller: str | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    outcome: str | None = None


@dataclass(frozen=True, slots=True)
class FinishResult:
    """What lq_finish did to one reservation."""

    status: FinishStatus
    state: str | None
    tenant: str | None
    charged_tokens: int | None
    refunded_tokens: int | None
    late: bool | None


@dataclass(frozen=True, slots=True)
class HeartbeatResult:
    """A heartbeat's answer: the new expiry, or the state that refused it."""

    state: str
    lease_expires_at: datetime | None
    lease_generation: int | None


@dataclass(frozen=True, slots=True)
class LayerStatus:
    """One layer's policy and balances, refilled to now."""

    scope: LayerScope
    tenant: str | None
    route: str | None
    policy: Policy
    policy_version: int
    tokens: float | None
    requests: float | None
    in_flight: int


@dataclass(frozen=True, slots=True)
class UsageTotals:
    """Ledger totals for a tenant over a period."""

    requests: int
    input_tokens: int
    output_tokens: int


# Errors that say the database did not answer, as opposed to refusing a statement.
_UNAVAILABLE: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    asyncpg.exceptions.PostgresConnectionError,
    asyncpg.exceptions.CannotConnectNowError,
    asyncpg.exceptions.AdminShutdownError,
    asyncpg.exceptions.QueryCanceledError,
    asyncpg.exceptions.LockNotAvailableError,
    asyncpg.exceptions.InterfaceError,
    asyncpg.exceptions.ConnectionDoesNotExistError,
)


@contextlib.contextmanager
def translate_errors() -> Any:
    """Turn driver errors that mean 'not answering' into StoreUnavailable."""
    try:
        yield
    except _UNAVAILABLE as exc:
        raise StoreUnavailable(f"database unavailable: {exc.__class__.__name__}: {exc}") from exc


async def open_connection(
    dsn: str,
    *,
    statement_timeout_ms: int,
    lock_timeout_ms: int,
    application_name: str = "llmquota",
) -> asyncpg.Connection:
    """One connection (for a CLI command) carrying the statement and lock timeouts."""
    with translate_errors():
        connection: asyncpg.Connection = await asyncpg.connect(
            dsn,
            server_settings={
                "statement_timeout": str(statement_timeout_ms),
                "lock_timeout": str(lock_timeout_ms),
                "application_name": application_name,
            },
        )
    return connection


class Store:
    """Typed access to the named statements over an asyncpg pool."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        concurrency_retry_ms: int = 1_000,
        admission_synchronous_commit: bool = True,
    ) -> None:
        self._pool = pool
        self._sql = queries()
        self._concurrency_retry_ms = concurrency_retry_ms
        self._admission_synchronous_commit = admission_synchronous_commit

    @classmethod
    async def connect(
        cls,
        dsn: str,
        *,
        min_size: int = 2,
        max_size: int = 10,
        statement_timeout_ms: int = 5_000,
        lock_timeout_ms: int = 2_000,
        concurrency_retry_ms: int = 1_000,
        admission_synchronous_commit: bool = True,
    ) -> Store:
        """Open a pool whose sessions carry the statement and lock timeouts."""
        with translate_errors():
            pool = await asyncpg.create_pool(
                dsn,
                min_size=min_size,
                max_size=max_size,
                server_settings={
                    "statement_timeout": str(statement_timeout_ms),
                    "lock_timeout": str(lock_timeout_ms),
                    "application_name": "llmquota",
                },
            )
        return cls(
            pool,
            concurrency_retry_ms=concurrency_retry_ms,
            admission_synchronous_commit=admission_synchronous_commit,
        )

    async def close(self) -> None:
        """Close every connection of the pool."""
        await self._pool.close()

    @contextlib.asynccontextmanager
    async def _connection(self) -> AsyncIterator[asyncpg.Connection]:
        with translate_errors():
            async with self._pool.acquire() as connection:
                yield connection

    async def _fetch(self, name: str, *args: Any) -> list[asyncpg.Record]:
        async with self._connection() as connection:
            rows: list[asyncpg.Record] = await connection.fetch(self._sql[name], *args)
            return rows

    async def admit(self, requests: Sequence[AdmitRequest]) -> list[AdmitDecision]:
        """Decide a batch of admissions in order, in one statement.

        With admission_synchronous_commit off, the statement's commit does not
        wait for the WAL flush (see admit_without_flush in queries.sql).
        """
        arrays = (
            [r.tenant for r in requests],
            [r.route for r in requests],
            [r.model for r in requests],
            [r.input_tokens for r in requests],
            [r.max_tokens for r in requests],
            [r.input_estimated for r in requests],
            [r.lease_seconds for r in requests],
            [r.idempotency_key for r in requests],
            [r.request_hash for r in requests],
        )
        if self._admission_synchronous_commit:
            rows = await self._fetch("admit", *arrays, self._concurrency_retry_ms)
        else:
            rows = await self._fetch("admit_without_flush", *arrays, self._concurrency_retry_ms)
        return [
            AdmitDecision(
                status=row["status"],
                reservation_id=row["reservation_id"],
                reserved_tokens=row["reserved_tokens"],
                lease_expires_at=row["lease_expires_at"],
                lease_generation=row["lease_generation"],
                limit_kind=row["limit_kind"],
                limit_scope=row["limit_scope"],
                retry_after_ms=row["retry_after_ms"],
                capacity=row["capacity"],
                remaining_tokens=row["remaining_tokens"],
                remaining_requests=row["remaining_requests"],
                remaining_in_flight=row["remaining_in_flight"],
                tenant=TenantFigures(
                    tokens_per_minute=row["tenant_tokens_per_minute"],
                    token_burst=row["tenant_token_burst"],
                    tokens=row["tenant_tokens"],
                    requests_per_minute=row["tenant_requests_per_minute"],
                    request_burst=row["tenant_request_burst"],
                    requests=row["tenant_requests"],
                ),
            )
            for row in rows
        ]

    async def finish(self, requests: Sequence[FinishRequest]) -> list[FinishResult]:
        """Settle, release or expire a batch of reservations, in one statement."""
        rows = await self._fetch(
            "finish",
            [r.reservation_id for r in requests],
            [r.action for r in requests],
            [r.caller for r in requests],
            [r.input_tokens for r in requests],
            [r.output_tokens for r in requests],
            [r.outcome for r in requests],
        )
        return [
            FinishResult(
                status=row["status"],
                state=row["state"],
                tenant=row["tenant"],
                charged_tokens=row["charged_tokens"],
                refunded_tokens=row["refunded_tokens"],
                late=row["late"],
            )
            for row in rows
        ]

    async def sweep(self, limit: int) -> tuple[int, int]:
        """Expire up to `limit` lapsed reservations: (count, tokens returned)."""
        rows = await self._fetch("sweep", limit)
        return int(rows[0]["expired"]), int(rows[0]["tokens_returned"])

    async def heartbeat(
        self, reservation_id: uuid.UUID, caller: str | None, lease_seconds: int | None
    ) -> HeartbeatResult | None:
        """Extend a live lease; None when no such reservation exists for the caller."""
        rows = await self._fetch("heartbeat", reservation_id, caller, lease_seconds)
        if not rows:
            return None
        row = rows[0]
        return HeartbeatResult(
            state=row["state"],
            lease_expires_at=row["lease_expires_at"],
            lease_generation=row["lease_generation"],
        )

    async def put_policy(
        self, scope: LayerScope, tenant: str | None, route: str | None, policy: Policy
    ) -> int:
        """Create or replace a layer's policy; returns its policy version."""
        p = policy.resolved()
        rows = await self._fetch(
            "put_policy",
            scope,
            tenant,
            route,
            p.tokens_per_minute,
            p.token_burst,
            p.requests_per_minute,
            p.request_burst,
            p.max_in_flight,
            p.lease_seconds,
        )
        return int(rows[0]["policy_version"])

    async def get_policy(
        self, scope: LayerScope, tenant: str | None, route: str | None
    ) -> tuple[Policy, int] | None:
        """A layer's policy and version, or None when the layer has none."""
        rows = await self._fetch("get_policy", scope, tenant, route)
        if not rows:
            return None
        row = rows[0]
        return _policy_from_row(row), int(row["policy_version"])

    async def ensure_tenant(self, tenant: str) -> None:
        """Register a tenant if it is new."""
        await self._fetch("ensure_tenant", tenant)

    async def tenant_exists(self, tenant: str) -> bool:
        """Whether a tenant is registered."""
        rows = await self._fetch("tenant_exists", tenant)
        return bool(rows[0][0])

    async def insert_api_key(self, key_hash: bytes, tenant: str | None) -> int:
        """Store a key digest; returns the key id."""
        rows = await self._fetch("insert_api_key", key_hash, tenant)
        return int(rows[0]["key_id"])

    async def insert_first_admin_key(self, key_hash: bytes) -> bool:
        """Store an admin key digest unless one exists; True if stored."""
        return bool(await self._fetch("insert_first_admin_key", key_hash))

    async def find_api_key(self, key_hash: bytes) -> tuple[int, str | None] | None:
        """(key id, tenant or None for admin) for a key digest, or None."""
        rows = await self._fetch("find_api_key", key_hash)
        if not rows:
            return None
        return int(rows[0]["key_id"]), rows[0]["tenant"]

    async def layer_status(self, tenant: str) -> list[LayerStatus]:
        """The global layer and the tenant's layers, refilled to now."""
        rows = await self._fetch("layer_status", tenant)
        return [
            LayerStatus(
                scope=row["scope"],
                tenant=row["tenant"],
                route=row["route"],
                policy=_policy_from_row(row),
                policy_version=int(row["policy_version"]),
                tokens=row["tokens"],
                requests=row["requests"],
                in_flight=int(row["in_flight"]),
            )
            for row in rows
        ]

    async def tenant_usage(self, tenant: str, start: datetime, end: datetime) -> UsageTotals:
        """Ledger totals for a tenant over [start, end)."""
        row = (await self._fetch("tenant_usage", tenant, start, end))[0]
        return UsageTotals(
            requests=int(row["requests"]),
            input_tokens=int(row["input_tokens"]),
            output_tokens=int(row["output_tokens"]),
        )

    async def ensure_ledger_partitions(self, months_ahead: int) -> dict[str, str]:
        """Make the ledger's monthly partitions exist; {partition: status}."""
        rows = await self._fetch("ensure_ledger_partitions", months_ahead)
        return {row["partition_name"]: row["status"] for row in rows}

    async def purge_finished(self, retention_seconds: int, limit: int) -> int:
        """Delete up to `limit` reservations finished before the retention window."""
        async with self._connection() as connection:
            status: str = await connection.execute(
                self._sql["purge_finished"], retention_seconds, limit
            )
        return int(status.rsplit(maxsplit=1)[-1])


def _policy_from_row(row: asyncpg.Record) -> Policy:
    return Policy(
        tokens_per_minute=row["tokens_per_minute"],
        token_burst=row["token_burst"],
        requests_per_minute=row["requests_per_minute"],
        request_burst=row["request_burst"],
        max_in_flight=row["max_in_flight"],
        lease_seconds=row["lease_seconds"],
    )
