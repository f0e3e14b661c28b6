"""Typed access to quotas, credits, webhooks and the alert outbox.

Beside store.py, over the same pool: one named statement of
sql/alerts_queries.sql per method, rows turned into domain records. The
decisions (which thresholds a change crossed, whether a reference was used)
are made by the statements and the functions of sql/quotas.sql.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime
from decimal import Decimal
from typing import Any

from llmquota.domain.alerts import AlertEvent, Delivery, Webhook
from llmquota.domain.ceiling_alerts import CeilingSample
from llmquota.domain.quotas import Quota, QuotaSpec, TopUp
from llmquota.store.connection import Row
from llmquota.store.pool import DeadlinePool
from llmquota.store.sqlfiles import named_queries


class AlertStore:
    """Quotas, credits, webhooks and alerts, one statement per call."""

    def __init__(self, pool: DeadlinePool, *, deadline_seconds: float | None = None) -> None:
        self._pool = pool
        self._sql = named_queries("alerts_queries.sql")
        self._deadline_seconds = deadline_seconds

    async def _fetch(self, name: str, *args: Any) -> list[Row]:
        return await self._pool.fetch(
            self._sql[name], args, deadline_seconds=self._deadline_seconds
        )

    async def put_quota(
        self, tenant: str, route: str | None, name: str, spec: QuotaSpec, key_id: int | None = None
    ) -> tuple[int, bool] | None:
        """Create or replace a quota (of key `key_id`, when given): (quota id, whether
        it is new); None when the tenant has no such key, or it is revoked."""
        rows = await self._fetch(
            "put_quota",
            tenant,
            route,
            name,
            spec.period,
            spec.timezone,
            spec.tokens,
            spec.cost,
            list(spec.models),
            list(spec.model_patterns),
            list(spec.alerts),
            spec.enforce,
            key_id,
        )
        if not rows:
            return None
        return int(rows[0]["quota_id"]), bool(rows[0]["created"])

    async def list_quotas(
        self,
        tenant: str,
        route: str | None = None,
        *,
        tenant_only: bool = False,
        name: str | None = None,
        key_id: int | None = None,
    ) -> list[Quota]:
        """A tenant's quotas (all, a route's, a key's or the tenant's own), with
        current usage."""
        rows = await self._fetch("list_quotas", tenant, route, tenant_only, name, key_id)
        return [_quota(row) for row in rows]

    async def delete_quota(
        self, tenant: str, route: str | None, name: str, key_id: int | None = None
    ) -> bool:
        """Delete a quota; False when there was none."""
        return bool(await self._fetch("delete_quota", tenant, route, name, key_id))

    async def credit_topup(self, tenant: str, amount: Decimal, reference: str) -> TopUp:
        """Add credit once per reference; `applied` False for a reference used before."""
        row = (await self._fetch("credit_topup", tenant, amount, reference))[0]
        return TopUp(
            entry_id=int(row["entry_id"]),
            amount=row["amount"],
            reference=reference,
            recorded_at=row["recorded_at"],
            applied=bool(row["applied"]),
        )

    async def credit_account(self, tenant: str) -> tuple[Decimal, Decimal]:
        """(balance, reserved); zeros for a tenant never topped up."""
        rows = await self._fetch("credit_account", tenant)
        if not rows:
            return Decimal(0), Decimal(0)
        return rows[0]["balance"], rows[0]["reserved"]

    async def credit_topups(self, tenant: str, limit: int) -> list[TopUp]:
        """The last `limit` top-ups, newest first."""
        rows = await self._fetch("credit_topups", tenant, limit)
        return [
            TopUp(
                entry_id=int(r["entry_id"]),
                amount=r["amount"],
                reference=r["reference"],
                recorded_at=r["recorded_at"],
            )
            for r in rows
        ]

    async def put_webhook(
        self, name: str, url: str, secret: str, tenant: str | None
    ) -> tuple[Webhook, bool]:
        """Create or replace a webhook: (it, whether it is new)."""
        row = (await self._fetch("put_webhook", name, url, secret, tenant))[0]
        hook = Webhook(name, url, tenant, row["created_at"], row["updated_at"])
        return hook, bool(row["created"])

    async def list_webhooks(self, name: str | None = None) -> list[Webhook]:
        """Every webhook, or the one named; never their secrets."""
        rows = await self._fetch("list_webhooks", name)
        return [
            Webhook(r["name"], r["url"], r["tenant"], r["created_at"], r["updated_at"])
            for r in rows
        ]

    async def delete_webhook(self, name: str) -> bool:
        """Delete a webhook and its pending deliveries; False when there was none."""
        return bool(await self._fetch("delete_webhook", name))

    async def fire_alert(
        self,
        event_type: str,
        tenant: str | None,
        subject: str,
        *,
        threshold: Decimal,
        window_start: datetime,
        window_end: datetime | None,
        usage: Decimal,
        limit: Decimal,
        projected_exhaustion_at: datetime | None = None,
        payload: dict[str, Any] | None = None,
    ) -> uuid.UUID | None:
        """Put an alert into the outbox unless it fired already; its id, or None."""
        rows = await self._fetch(
            "fire_alert",
            event_type,
            tenant,
            subject,
            threshold,
            window_start,
            window_end,
            usage,
            limit,
            projected_exhaustion_at,
            json.dumps(payload or {}),
        )
        event_id: uuid.UUID | None = rows[0]["event_id"]
        return event_id

    async def record_ceiling_samples(
        self, samples: Sequence[CeilingSample]
    ) -> list[tuple[CeilingSample, uuid.UUID | None]]:
        """Apply samples to their ceilings' alert episodes in one statement; each episode
        it opened, with its alert's event id (None: that alert had fired already)."""
        if not samples:
            return []
        rows = await self._fetch(
            "record_ceiling_samples",
            [s.ceiling for s in samples],
            [s.dimension for s in samples],
            [s.threshold for s in samples],
            [s.utilization for s in samples],
            [Decimal(s.usage) for s in samples],
            [Decimal(s.capacity) for s in samples],
            [s.hysteresis for s in samples],
            [s.quiet_seconds for s in samples],
            [s.sampled_at for s in samples],
        )
        by_key = {(s.ceiling, s.dimension, s.threshold): s for s in samples}
        return [
            (by_key[(row["ceiling"], row["dimension"], row["threshold"])], row["event_id"])
            for row in rows
        ]

    async def prune_ceiling_alert_states(
        self, samples: Sequence[CeilingSample], read_at: datetime | None
    ) -> int:
        """Forget the episodes of what `samples` (of a read at `read_at`; None: a read
        that found no ceiling) no longer name; how many state rows went."""
        rows = await self._fetch(
            "prune_ceiling_alert_states",
            [s.ceiling for s in samples],
            [s.dimension for s in samples],
            [s.threshold for s in samples],
            read_at,
        )
        return len(rows)

    async def list_alerts(self, tenant: str, limit: int) -> list[AlertEvent]:
        """A tenant's last `limit` alerts, newest first, with delivery counts."""
        rows = await self._fetch("list_alerts", tenant, limit)
        return [_event(row) for row in rows]

    async def recent_alerts(self, limit: int) -> list[AlertEvent]:
        """Every tenant's last `limit` alerts, newest first, with delivery counts."""
        rows = await self._fetch("recent_alerts", limit)
        return [_event(row) for row in rows]

    async def claim_deliveries(
        self,
        limit: int,
        claim_seconds: float,
        per_destination: int = 1_000,
        in_flight: Mapping[str, int] | None = None,
    ) -> list[Delivery]:
        """Claim up to `limit` due deliveries for `claim_seconds`, at most
        `per_destination` of one webhook counting those `in_flight` already (see
        claim_deliveries)."""
        busy = dict(in_flight or {})
        rows = await self._fetch(
            "claim_deliveries",
            limit,
            claim_seconds,
            per_destination,
            list(busy),
            list(busy.values()),
        )
        return [
            Delivery(
                event=_event(row),
                webhook=row["webhook"],
                url=row["url"],
                secret=row["secret"],
                attempt=int(row["attempts"]),
                age_seconds=float(row["age_seconds"]),
            )
            for row in rows
        ]

    async def record_delivery(
        self,
        delivery: Delivery,
        *,
        delivered: bool,
        status: int | None,
        error: str | None,
        retry_seconds: float | None,
        duration_ms: int,
    ) -> bool:
        """Record one attempt; True when this claim still held the delivery."""
        rows = await self._fetch(
            "record_delivery",
            delivery.event.event_id,
            delivery.webhook,
            delivery.attempt,
            status,
            error,
            delivered,
            retry_seconds,
            duration_ms,
        )
        return bool(rows[0]["updated"])


def _payload(value: object) -> dict[str, Any]:
    if isinstance(value, str):
        loaded: dict[str, Any] = json.loads(value)
        return loaded
    return dict(value) if isinstance(value, dict) else {}


def _event(row: Row) -> AlertEvent:
    keys = set(row.keys())
    return AlertEvent(
        event_id=row["event_id"],
        event_type=row["event_type"],
        tenant=row["tenant"],
        subject=row["subject"],
        threshold=row["threshold"],
        window_start=row["window_start"],
        window_end=row["window_end"],
        usage=row["usage"],
        limit=row["limit_value"],
        projected_exhaustion_at=row["projected_exhaustion_at"],
        payload=_payload(row["payload"]),
        created_at=row["created_at"] if "created_at" in keys else None,
        deliveries=int(row["deliveries"]) if "deliveries" in keys else 0,
        delivered=int(row["delivered"]) if "delivered" in keys else 0,
        gave_up=int(row["gave_up"]) if "gave_up" in keys else 0,
    )


def _quota(row: Row) -> Quota:
    spec = QuotaSpec(
        period=row["period"],
        timezone=row["timezone"],
        tokens=row["tokens"],
        cost=row["cost"],
        models=tuple(row["models"]),
        alerts=tuple(row["alerts"]),
        enforce=row["enforce"],
    )
    return Quota(
        quota_id=int(row["quota_id"]),
        tenant=row["tenant"],
        route=row["route"],
        name=row["name"],
        spec=spec,
        key_id=row["api_key_id"],
        window_start=row["window_start"],
        window_end=row["window_end"],
        usage_tokens=int(row["usage_tokens"]),
        usage_cost=row["usage_cost"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
    )
