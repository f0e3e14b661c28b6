"""Quotas, prepaid credits, webhooks and alerts, for the REST API and the CLI.

Like AdminService, the adapters hand it validated domain values and get
records or typed errors back; it owns the rules that are not HTTP's: a quota
or a webhook names a registered tenant, a top-up's reference adds once and
a repeat with another amount is a conflict, not a silent success.
"""

from __future__ import annotations

from decimal import Decimal

from llmquota.domain.alerts import AlertEvent, Webhook
from llmquota.domain.errors import IdempotencyConflict, UnknownTenant
from llmquota.domain.quotas import CreditAccount, Quota, QuotaSpec, TopUp
from llmquota.domain.validation import check_name
from llmquota.store.alerts import AlertStore
from llmquota.store.store import Store

# How many top-ups GET /credits shows, and alerts GET /alerts lists at most.
RECENT_TOPUPS = 10
MAX_ALERTS_LISTED = 1_000


class NotFound(UnknownTenant):
    """No such quota or webhook (a 404, like an unknown tenant)."""


class AlertService:
    """Administration of quotas, credits, webhooks and alerts of one database."""

    def __init__(self, store: Store, *, deadline_seconds: float | None = None) -> None:
        self._store = store
        self._alerts = AlertStore(store.pool, deadline_seconds=deadline_seconds)
        self._deadline_seconds = deadline_seconds

    @property
    def alerts(self) -> AlertStore:
        """The store the delivery loop claims from (the same pool)."""
        return self._alerts

    async def _require_tenant(self, tenant: str) -> None:
        if not await self._store.tenant_exists(tenant, deadline_seconds=self._deadline_seconds):
            raise UnknownTenant(f"unknown tenant {tenant!r}")

    async def put_quota(
        self, tenant: str, route: str | None, name: str, spec: QuotaSpec, key_id: int | None = None
    ) -> tuple[Quota, bool]:
        """Create or replace a quota of a registered tenant (of one of its routes, or
        of its key `key_id`): (it, whether it is new)."""
        check_name("tenant", tenant)
        if route is not None:
            check_name("route", route)
        check_name("name", name)
        await self._require_tenant(tenant)
        stored = await self._alerts.put_quota(tenant, route, name, spec, key_id)
        if stored is None:
            raise NotFound(f"unknown key {key_id} (or revoked)")
        return await self.get_quota(tenant, route, name, key_id), stored[1]

    async def get_quota(
        self, tenant: str, route: str | None, name: str, key_id: int | None = None
    ) -> Quota:
        """One quota with its current window's usage, or NotFound."""
        found = await self._alerts.list_quotas(
            tenant, route, tenant_only=route is None and key_id is None, name=name, key_id=key_id
        )
        if not found:
            raise NotFound(f"no quota {name!r}")
        return found[0]

    async def list_quotas(
        self, tenant: str, route: str | None = None, key_id: int | None = None
    ) -> list[Quota]:
        """A tenant's quotas, its routes' and keys' too (or one route's or key's only)."""
        await self._require_tenant(tenant)
        return await self._alerts.list_quotas(tenant, route, key_id=key_id)

    async def delete_quota(
        self, tenant: str, route: str | None, name: str, key_id: int | None = None
    ) -> None:
        """Delete a quota (its past windows stay for the reports), or NotFound."""
        if not await self._alerts.delete_quota(tenant, route, name, key_id):
            raise NotFound(f"no quota {name!r}")

    async def top_up(self, tenant: str, amount: Decimal, reference: str) -> TopUp:
        """Add credit once per reference. A repeat of the same top-up answers the
        first (applied False); the same reference with another amount is refused."""
        await self._require_tenant(tenant)
        topup = await self._alerts.credit_topup(tenant, amount, reference)
        if not topup.applied and topup.amount != amount:
            raise IdempotencyConflict(
                f"reference {reference!r} was used for a top-up of {topup.amount}, not {amount}"
            )
        return topup

    async def credits(self, tenant: str) -> CreditAccount:
        """Balance, reserved and the last top-ups of a registered tenant."""
        await self._require_tenant(tenant)
        balance, reserved = await self._alerts.credit_account(tenant)
        topups = await self._alerts.credit_topups(tenant, RECENT_TOPUPS)
        return CreditAccount(tenant, balance, reserved, tuple(topups))

    async def put_webhook(
        self, name: str, url: str, secret: str, tenant: str | None
    ) -> tuple[Webhook, bool]:
        """Create or replace a webhook (of a registered tenant, when it names one)."""
        check_name("name", name)
        if tenant is not None:
            check_name("tenant", tenant)
            await self._require_tenant(tenant)
        return await self._alerts.put_webhook(name, url, secret, tenant)

    async def get_webhook(self, name: str) -> Webhook:
        """One webhook without its secret, or NotFound."""
        found = await self._alerts.list_webhooks(name)
        if not found:
            raise NotFound(f"no webhook {name!r}")
        return found[0]

    async def list_webhooks(self) -> list[Webhook]:
        return await self._alerts.list_webhooks()

    async def delete_webhook(self, name: str) -> None:
        """Delete a webhook and its pending deliveries, or NotFound."""
        if not await self._alerts.delete_webhook(name):
            raise NotFound(f"no webhook {name!r}")

    async def list_alerts(self, tenant: str, limit: int = 100) -> list[AlertEvent]:
        """A registered tenant's last alerts, newest first."""
        await self._require_tenant(tenant)
        return await self._alerts.list_alerts(tenant, max(1, min(limit, MAX_ALERTS_LISTED)))

    async def recent_alerts(self, limit: int = 100) -> list[AlertEvent]:
        """Every tenant's last alerts, newest first (the console's alerts page)."""
        return await self._alerts.recent_alerts(max(1, min(limit, MAX_ALERTS_LISTED)))
