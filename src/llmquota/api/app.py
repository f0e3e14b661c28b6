"""The FastAPI application: wiring and the lifespan.

`create_app(settings)` builds an app whose lifespan opens one Limiter (one
pool) per worker process, and the admin service over the same store. Errors
are rendered in one shape everywhere (llmquota.api.errors):
{"type": "error", "error": {"type": ..., "message": ...}, "request_id": ...},
except on the proxy endpoints (llmquota.api.proxy), which answer in the
provider's format.

The middlewares, outermost first: request ids (and the last word on errors
no handler took), the tenant fair share, the request's size and time
limits, then admit and settle answered without FastAPI's routing
(llmquota.api.hotpaths). The lifespan also hands the server protocol its limits on request
heads (llmquota.api.protocols), through the lifespan state uvicorn keeps,
and runs the task that reads utilization gauges from the database
(llmquota.admin.gauges), so that no request pays for them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from starlette.types import Scope

from llmquota.admin.alerts import AlertService
from llmquota.admin.ceilings_over_cells import ceiling_alerts_of_the_deployment
from llmquota.admin.console import ConsoleService
from llmquota.admin.decision_flush import decision_counts_flushing
from llmquota.admin.gauges import UtilizationGauges
from llmquota.admin.running import maintenance_running
from llmquota.admin.service import AdminService
from llmquota.admission.heap import settle_after_startup
from llmquota.admission.limiter import Limiter
from llmquota.api.application import Application
from llmquota.api.auth import Authenticator, Triage
from llmquota.api.bodylimit import RequestLimits
from llmquota.api.console import install_console
from llmquota.api.errors import install_error_handlers
from llmquota.api.fairness import TenantFairShare
from llmquota.api.hotpaths import HotPaths
from llmquota.api.openapi import install_openapi
from llmquota.api.protocols import HEAD_LIMITS_STATE_KEY, HeadLimits
from llmquota.api.proxy import Proxy, proxy_router
from llmquota.api.requestids import RequestIds
from llmquota.api.routes import router
from llmquota.api.webhooks import delivery_running
from llmquota.config import Settings
from llmquota.store.alerts import AlertStore

# The paths whose endpoints all take an API key. The others (healthz, metrics,
# the docs) take none, or a credential of their own: they are neither gated
# nor refused by what the authenticator remembers.
API_KEY_PATHS = "/v1/"


def _triage(scope: Scope) -> Triage:
    """A request's fair-share lane, or its refusal, from the authenticator's memory (no I/O)."""
    authenticator: Authenticator | None = getattr(scope["app"].state, "authenticator", None)
    if authenticator is None or not scope["path"].startswith(API_KEY_PATHS):
        return Triage()
    authorization = api_key = None
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            authorization = value.decode("latin-1")
        elif name == b"x-api-key":  # the anthropic SDK's way, on the proxy endpoints
            api_key = value.decode("latin-1")
    if api_key and not (authorization or "").lower().startswith("bearer "):
        authorization = f"Bearer {api_key}"
    return authenticator.triage(authorization, _client_address(scope))


def _client_address(scope: Scope) -> str:
    """The peer's address (behind a proxy, the proxy's, unless uvicorn rewrites it)."""
    client = scope.get("client")
    return str(client[0]) if client else ""


@contextlib.asynccontextmanager
async def _background_tasks(
    app: FastAPI, limiter: Limiter, admin: AdminService, settings: Settings, dsn: str
) -> AsyncIterator[None]:
    """The server's own loops: utilization gauges read from the database, alert
    delivery, the provider ceilings' alert detector, and the maintenance (the
    sweeper, on the one leader), for as long as the app runs."""
    app.state.gauges = UtilizationGauges(
        admin, limiter.metrics, tenants=settings.tenant_utilization_metrics
    )
    gauges = asyncio.create_task(app.state.gauges.run(settings.ceiling_metrics_refresh_seconds))
    try:
        # Alerts are delivered by every server worker (and `sweep --loop`): the
        # claim's SKIP LOCKED keeps them from sending one delivery twice.
        delivery_store = AlertStore(
            limiter.store.pool, deadline_seconds=settings.statement_timeout_ms / 1000.0 + 1.0
        )
        async with (
            decision_counts_flushing(
                limiter.metrics,
                app.state.console.store,
                settings.decision_counts_flush_seconds,
            ),
            delivery_running(delivery_store, settings, limiter.metrics),
            # Every worker watches the ceilings too (not one cell's service):
            # the record statement's guarded upsert writes each crossing once.
            ceiling_alerts_of_the_deployment(limiter.store, delivery_store, settings, dsn),
            maintenance_running(limiter.store, settings, limiter.metrics, dsn),
        ):
            yield
    finally:
        gauges.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await gauges


def create_app(
    settings: Settings | None = None, dsn: str | None = None, *, server_worker: bool = False
) -> FastAPI:
    """Build the app; the database is `dsn`, else settings.database_url. A server
    worker's (`server_worker`) heap is frozen once it has started (worker_heap.py)."""
    settings = settings or Settings()
    database = dsn or settings.database_url
    if not database:
        raise RuntimeError("no database: set LLMQUOTA_DATABASE_URL or use `llmquota serve`")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        limiter = await Limiter.connect(database, settings)
        admin = AdminService(
            limiter.store,
            deadline_seconds=limiter.deadline_seconds,
            report_deadline_seconds=settings.statement_timeout_ms / 1000.0,
            policies_written=limiter.outage.policies_written,
            admin_key_configured=bool(settings.admin_key),
            oversubscription_rule=settings.oversubscription_rule,
        )
        authenticator = Authenticator(
            admin.find_key, settings.admin_key, settings, limiter.metrics, admin.keys.note_use
        )
        limiter.outage.changes.watch_keys(authenticator.key_changed)
        limiter.outage.changes.watch_tenants(authenticator.tenant_changed)
        app.state.limiter = limiter
        app.state.admin = admin
        app.state.authenticator = authenticator
        _attach_services(app, limiter, settings)
        if server_worker:
            settle_after_startup()
        try:
            async with _background_tasks(app, limiter, admin, settings, database):
                yield {HEAD_LIMITS_STATE_KEY: HeadLimits.from_settings(settings)}
        finally:
            try:
                await app.state.proxy.close()  # streams still running settle first
            finally:
                await authenticator.close()
                await limiter.close()

    app = Application(
        title="llmquota",
        summary="Admission control for LLM providers: reserve, then settle.",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.settings = settings
    _add_middlewares(app, settings)
    install_error_handlers(app)
    app.include_router(router)
    install_console(app)
    formats = {upstream.format for upstream in settings.upstreams()}
    app.include_router(
        proxy_router({"openai": "openai" in formats, "anthropic": "anthropic" in formats})
    )
    install_openapi(app, settings.max_wait_ms_cap)
    return app


def _attach_services(app: FastAPI, limiter: Limiter, settings: Settings) -> None:
    """The proxy, the alert service and the console's reads, on the app's state."""
    app.state.proxy = Proxy(settings, limiter.metrics.registry)  # one /metrics for both
    app.state.alert_service = AlertService(limiter.store, deadline_seconds=limiter.deadline_seconds)
    app.state.console = ConsoleService(
        limiter.store,
        deadline_seconds=limiter.deadline_seconds,
        session_seconds=settings.console_session_seconds,
    )


def _add_middlewares(app: FastAPI, settings: Settings) -> None:
    """The hot paths, the request limits, the fair share and request ids, innermost first."""
    app.state.metrics_token = settings.metrics_token
    # Innermost: admit and settle answered without FastAPI's routing (hotpaths.py).
    app.add_middleware(HotPaths)
    app.add_middleware(
        RequestLimits,
        max_body_bytes=settings.max_body_bytes,
        max_head_bytes=settings.max_header_bytes,
        read_timeout_seconds=settings.body_read_timeout_seconds,
    )
    app.add_middleware(
        TenantFairShare,
        triage=_triage,
        max_in_progress=settings.tenant_max_in_progress,
        max_waiting=settings.tenant_max_queued,
        unknown_max_in_progress=settings.unknown_key_max_in_progress,
        unknown_max_waiting=settings.unknown_key_max_waiting,
    )
    # Added last, so outermost: every answer and every error below has its id.
    app.add_middleware(RequestIds)


def create_app_from_env() -> FastAPI:
    """Factory for uvicorn workers: everything from LLMQUOTA_* variables."""
    return create_app(Settings(), server_worker=True)
