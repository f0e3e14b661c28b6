"""Operations: liveness for load balancers, metrics for Prometheus.

Neither needs a key: a probe or a scraper must not hold a secret. Liveness
includes a database round trip, through the admin service, so that a worker
whose database is away reports itself unhealthy within the decision deadline.
"""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import PlainTextResponse

from llmquota.api.dependencies import AdminDep, LimiterDep

router = APIRouter(tags=["operations"])


@router.get("/healthz")
async def healthz(admin: AdminDep) -> dict[str, str]:
    """Liveness plus a database round trip, within the decision deadline (else 503)."""
    await admin.ping()
    return {"status": "ok"}


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(limiter: LimiterDep) -> Response:
    """Prometheus metrics of this worker."""
    return Response(limiter.metrics.render(), media_type="text/plain; version=0.0.4")
