"""The only code that talks to PostgreSQL.

A thin connector in procrastinate's style: each method runs one named
statement from sql/queries.sql in one round trip and turns rows into typed
records. No decision is made here and no row is read, changed in Python and
written back: the statements do the atomic work. Driver errors that mean
"the database is not answering" become StoreUnavailable.

Decisions can carry a deadline; pool.py says how a statement that outlives
it is abandoned without holding the caller.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from llmquota.domain.errors import PreconditionFailed
from llmquota.domain.policy import Policy
from llmquota.domain.records import (
    AdmitDecision,
    AdmitRequest,
    AuditFinding,
    AuditSummary,
    FinishRequest,
    FinishResult,
    HeartbeatResult,
    LayerStatus,
    PathUsage,
    PolicySnapshotRows,
    StoredPolicy,
    UsageTotals,
)
from llmquota.domain.vocabulary import Scope
from llmquota.store.admit_statement import AdmitStatement
from llmquota.store.allotments import AllotmentStore
from llmquota.store.budget_moves import BudgetMoveStore
from llmquota.store.catalog import Catalog
from llmquota.store.cells import cell_index_named_in
from llmquota.store.connection import Row
from llmquota.store.decisions import (
    finish_arguments,
    finish_results,
)
from llmquota.store.estimates import EstimateStore
from llmquota.store.keys import KeyStore
from llmquota.store.outage import OutageStore
from llmquota.store.policy_rows import SnapshotLayers, policy_from_row
from llmquota.store.pool import DeadlinePool
from llmquota.store.response_cache import ResponseCacheStore
from llmquota.store.sqlfiles import queries
from llmquota.store.tenants import TenantDirectory


class Store:
    """Typed access to the named statements over a pool whose calls can carry a deadline."""

    def __init__(
        self,
        pool: DeadlinePool,
        concurrency_retry_ms: int = 1_000,
        admission_synchronous_commit: bool = True,
    ) -> None:
        self._pool = pool
        self._sql = queries()
        # Plans, tenant policies on them, provider ceilings (store/catalog.py).
        self.catalog = Catalog(pool, self._sql)
        # The tenant listing and deletion (store/tenants.py).
        self.tenants = TenantDirectory(pool, self._sql)
        # The learned output histograms (store/estimates.py).
        self.estimates = EstimateStore(pool, self._sql)
        # Recording outage journals, and the budgets for `local` (store/outage.py).
        self.outage = OutageStore(pool, self._sql)
        # API keys and tenant suspension (store/keys.py).
        self.keys = KeyStore(pool, self._sql)
        # The proxy's response cache (store/response_cache.py).
        self.response_cache = ResponseCacheStore(pool)
        # Slices of layers' room that workers decide from (store/allotments.py).
        self.allotments = AllotmentStore(pool, self._sql)
        # Budget moved between cells' global slices (store/budget_moves.py).
        self.budget_moves = BudgetMoveStore(pool, self._sql)
        self._concurrency_retry_ms = concurrency_retry_ms
        # The last policy snapshot's layers, kept where unchanged (store/policy_rows.py).
        self._snapshot_layers = SnapshotLayers()
        self.dsn: str | None = None  # set by connect: what a listener connects to
        # Set by connect: the 0-based cell the DSN names, if any, which the
        # reservation ids its worker makes name (domain/cell_hints.py).
        self.cell_index: int | None = None
        self._admit = AdmitStatement(
            pool, self._sql, concurrency_retry_ms, admission_synchronous_commit
        )

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
        transaction_pooler: bool = False,
    ) -> Store:
        """Open a pool whose sessions carry the statement and lock timeouts."""
        pool = await DeadlinePool.connect(
            dsn,
            min_size=min_size,
            max_size=max_size,
            statement_timeout_ms=statement_timeout_ms,
            lock_timeout_ms=lock_timeout_ms,
            transaction_pooler=transaction_pooler,
        )
        store = cls(
            pool,
            concurrency_retry_ms=concurrency_retry_ms,
            admission_synchronous_commit=admission_synchronous_commit,
        )
        store.dsn, store.cell_index = dsn, cell_index_named_in(dsn)
        return store

    @property
    def pool(self) -> DeadlinePool:
        """The pool, for the stores of other tables that share it (store.alerts)."""
        return self._pool

    async def close(self) -> None:
        """Close every connection of the pool; cut them if the server does not answer."""
        await self._pool.close()

    async def _fetch(
        self, name: str, *args: Any, deadline_seconds: float | None = None
    ) -> list[Row]:
        return await self._pool.fetch(self._sql[name], args, deadline_seconds=deadline_seconds)

    async def admit(
        self,
        requests: Sequence[AdmitRequest],
        *,
        deadline_seconds: float | None = None,
        reservation_ids: Sequence[uuid.UUID] | None = None,
    ) -> list[AdmitDecision]:
        """Decide a batch of admissions in order, in one statement; with
        `deadline_seconds` it writes nothing past it, and it admits under
        `reservation_ids` when given (store/admit_statement.py)."""
        return await self._admit.admit(requests, deadline_seconds, reservation_ids)

    async def finish(
        self, requests: Sequence[FinishRequest], *, deadline_seconds: float | None = None
    ) -> list[FinishResult]:
        """Settle, release or expire a batch of reservations, in one statement."""
        rows = await self._fetch(
            "finish", *finish_arguments(requests), deadline_seconds=deadline_seconds
        )
        return finish_results(rows)

    async def sweep(self, limit: int, *, deadline_seconds: float | None = None) -> tuple[int, int]:
        """Expire up to `limit` lapsed reservations: (count, tokens returned)."""
        rows = await self._fetch("sweep", limit, deadline_seconds=deadline_seconds)
        return int(rows[0]["expired"]), int(rows[0]["tokens_returned"])

    async def heartbeat(
        self,
        reservation_id: uuid.UUID,
        caller: str | None,
        lease_seconds: int | None,
        expected_generation: int | None = None,
        *,
        relayed: bool = False,
        deadline_seconds: float | None = None,
    ) -> HeartbeatResult | None:
        """Extend a live lease (`relayed`: mark relayed_at); None: no such reservation."""
        rows = await self._fetch(
            "heartbeat",
            reservation_id,
            caller,
            lease_seconds,
            expected_generation,
            relayed,
            deadline_seconds=deadline_seconds,
        )
        if not rows:
            return None
        row = rows[0]
        return HeartbeatResult(
            state=row["state"],
            lease_expires_at=row["lease_expires_at"],
            lease_generation=row["lease_generation"],
            lease_live=bool(row["lease_live"]),
            current_generation=row["current_generation"],
        )

    async def ping(self, *, deadline_seconds: float) -> None:
        """One round trip, to learn whether the database answers again."""
        await self._pool.fetch("SELECT 1", (), deadline_seconds=deadline_seconds)

    async def outage_id_key(self, *, deadline_seconds: float | None = None) -> bytes:
        """The key outage reservation ids are signed with."""
        rows = await self._fetch("outage_id_key", deadline_seconds=deadline_seconds)
        return bytes(rows[0]["key"])

    async def policy_snapshot(
        self,
        known_version: tuple[int, int] | None,
        max_layers: int,
        *,
        deadline_seconds: float | None = None,
    ) -> PolicySnapshotRows:
        """Every layer's policy, unless the snapshot version is still `known_version`."""
        known = known_version or (-1, -1)
        rows = await self._fetch(
            "policy_snapshot", known[0], known[1], max_layers, deadline_seconds=deadline_seconds
        )
        version = (int(rows[0]["snapshot_version"]), int(rows[0]["layer_count"]))
        if rows[0]["scope"] is None:
            return PolicySnapshotRows(version=version, layers=None if version == known else [])
        return PolicySnapshotRows(version=version, layers=self._snapshot_layers.layers(rows))

    async def audit(self, *, deadline_seconds: float | None = None) -> list[AuditFinding]:
        """Every drift between counters and journal; empty when the books agree."""
        rows = await self._fetch("audit", deadline_seconds=deadline_seconds)
        return [
            AuditFinding(
                check_name=row["check_name"],
                subject=row["subject"],
                expected=row["expected"],
                actual=row["actual"],
            )
            for row in rows
        ]

    async def audit_summary(self, *, deadline_seconds: float | None = None) -> AuditSummary:
        """Counts of what the journal holds."""
        row = (await self._fetch("audit_summary", deadline_seconds=deadline_seconds))[0]
        return AuditSummary(
            active=int(row["active"]),
            reserved_tokens=int(row["reserved_tokens"]),
            finished=int(row["finished"]),
            outage_admissions=int(row["outage_admissions"]),
            ledger_rows=int(row["ledger_rows"]),
        )

    async def put_policy(
        self,
        scope: Scope,
        tenant: str | None,
        route: str | None,
        policy: Policy,
        *,
        fallback_models: Sequence[str] = (),
        shards: int | None = None,
        if_match: Sequence[str] | None = None,
        deadline_seconds: float | None = None,
    ) -> int:
        """Create or replace a layer's policy; returns its policy version.

        A tenant's goes through the catalog with the fields the policy was given
        (no plan); the global layer's is split over `shards` rows (None: as now).
        `if_match` (ETags or "*"): PreconditionFailed unless the layer's is one of them.
        """
        if scope == "tenant" and tenant is not None:
            own = policy.model_dump(mode="json", include=policy.model_fields_set, exclude_none=True)
            if fallback_models:
                own["fallback_models"] = list(fallback_models)
            version = await self.catalog.put_tenant_policy(
                tenant, None, own, if_match=if_match, deadline_seconds=deadline_seconds
            )
            assert version is not None  # no plan to miss
            return version
        if scope == "global":
            return await self.catalog.put_global_policy(
                policy, shards, if_match=if_match, deadline_seconds=deadline_seconds
            )
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
            p.failure_mode,
            list(fallback_models),
            _estimate_json(p),
            None if if_match is None else list(if_match),
            p.request_cost,
            p.uses_concurrency,
            _cache_json(p),
            p.admission,
            deadline_seconds=deadline_seconds,
        )
        if not rows:
            raise PreconditionFailed(f"the policy of route {route!r} changed since that ETag")
        return int(rows[0]["policy_version"])

    async def get_policy(
        self,
        scope: Scope,
        tenant: str | None,
        route: str | None,
        *,
        deadline_seconds: float | None = None,
    ) -> StoredPolicy | None:
        """A layer's effective policy and version, or None when the layer has none."""
        rows = await self._fetch(
            "get_policy", scope, tenant, route, deadline_seconds=deadline_seconds
        )
        if not rows:
            return None
        row = rows[0]
        return StoredPolicy(
            policy=policy_from_row(row),
            policy_version=int(row["policy_version"]),
            plan=row["plan"],
            fallback_models=tuple(row["fallback_models"]),
            prepaid=bool(row["prepaid"]),
            shards=int(row["shards"]),
        )

    async def ensure_tenant(self, tenant: str, *, deadline_seconds: float | None = None) -> None:
        """Register a tenant if it is new."""
        await self._fetch("ensure_tenant", tenant, deadline_seconds=deadline_seconds)

    async def tenant_exists(self, tenant: str, *, deadline_seconds: float | None = None) -> bool:
        """Whether a tenant is registered."""
        rows = await self._fetch("tenant_exists", tenant, deadline_seconds=deadline_seconds)
        return bool(rows[0][0])

    async def layer_status(
        self, tenant: str, *, deadline_seconds: float | None = None
    ) -> list[LayerStatus]:
        """The global layer and the tenant's layers, refilled to now, with the room
        workers hold in slices of them."""
        rows = await self._fetch("layer_status", tenant, deadline_seconds=deadline_seconds)
        return [
            LayerStatus(
                scope=row["scope"],
                tenant=row["tenant"],
                route=row["route"],
                policy=policy_from_row(row),
                policy_version=int(row["policy_version"]),
                tokens=row["tokens"],
                requests=row["requests"],
                in_flight=int(row["in_flight"]),
                plan=row["plan"],
                fallback_models=tuple(row["fallback_models"]),
                prepaid=bool(row["prepaid"]),
                shards=int(row["shards"]),
                allotted_tokens=int(row["allotted_tokens"]),
                allotted_requests=int(row["allotted_requests"]),
            )
            for row in rows
        ]

    async def tenant_usage(
        self,
        tenant: str,
        start: datetime,
        end: datetime,
        *,
        deadline_seconds: float | None = None,
    ) -> UsageTotals:
        """Ledger totals for a tenant over [start, end), and the same by serving path."""
        rows = await self._fetch(
            "tenant_usage", tenant, start, end, deadline_seconds=deadline_seconds
        )
        total, *paths = rows  # the totals first (serving_path NULL), then each path
        return UsageTotals(
            requests=int(total["requests"]),
            input_tokens=int(total["input_tokens"]),
            output_tokens=int(total["output_tokens"]),
            by_serving_path={
                row["serving_path"]: PathUsage(
                    requests=int(row["requests"]),
                    input_tokens=int(row["input_tokens"]),
                    output_tokens=int(row["output_tokens"]),
                    saved_input_tokens=int(row["saved_input_tokens"]),
                    saved_output_tokens=int(row["saved_output_tokens"]),
                )
                for row in paths
            },
        )

    async def ensure_ledger_partitions(
        self, months_ahead: int, *, deadline_seconds: float | None = None
    ) -> dict[str, str]:
        """Make the ledger's monthly partitions exist; {partition: status}."""
        rows = await self._fetch(
            "ensure_ledger_partitions", months_ahead, deadline_seconds=deadline_seconds
        )
        return {row["partition_name"]: row["status"] for row in rows}

    async def purge_finished(
        self, retention_seconds: int, limit: int, *, deadline_seconds: float | None = None
    ) -> int:
        """Delete up to `limit` reservations finished before the retention window."""
        rows = await self._fetch(
            "purge_finished", retention_seconds, limit, deadline_seconds=deadline_seconds
        )
        return int(rows[0]["purged"])


def _estimate_json(policy: Policy) -> str | None:
    """A policy's output_estimate as the jsonb the layer stores (None: unset)."""
    estimate = policy.output_estimate
    return None if estimate is None else estimate.model_dump_json()


def _cache_json(policy: Policy) -> str | None:
    """A policy's cache as the jsonb the layer stores (None: unset)."""
    return None if policy.cache is None else policy.cache.model_dump_json()
