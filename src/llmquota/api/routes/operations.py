"""Operations: liveness for load balancers, metrics for Prometheus.

Liveness needs no key: a probe must not hold a secret. It includes a
database round trip, through the admin service, so that a worker whose
database is away reports itself unhealthy within the decision deadline.

Metrics are open unless `LLMQUOTA_METRICS_TOKEN` is set: then a scraper
sends it as a bearer token (Prometheus' `authorization` setting), since the
series name tenants and show their traffic. The token is compared by its
digest in constant time; a wrong or missing one gets 401.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Request, Response
from fastapi.responses import PlainTextResponse
from starlette.exceptions import HTTPException

from llmquota.api.dependencies import AdminDep, LimiterDep

UNAUTHORIZED = 401

router = APIRouter(tags=["operations"])


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


async def metrics_scraper(
    request: Request, authorization: Annotated[str | None, Header()] = None
) -> None:
    """Let the request through if no metrics token is set, or it carries the token."""
    expected: str | None = request.app.state.metrics_token
    if expected is None:
        return
    scheme, _, token = (authorization or "").partition(" ")
    # Digests of equal length, so the comparison's time says nothing about the token.
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        _digest(token.strip()), _digest(expected)
    ):
        raise HTTPException(
            UNAUTHORIZED, "missing or invalid metrics token", headers={"WWW-Authenticate": "Bearer"}
        )


@router.get("/healthz")
async def healthz(admin: AdminDep) -> dict[str, str]:
    """Liveness plus a database round trip, within the decision deadline (else 503)."""
    await admin.ping()
    return {"status": "ok"}


@router.get("/metrics", response_class=PlainTextResponse, dependencies=[Depends(metrics_scraper)])
async def metrics(limiter: LimiterDep) -> Response:
    """Prometheus metrics of this worker (a bearer token if LLMQUOTA_METRICS_TOKEN is set)."""
    return Response(limiter.metrics.render(), media_type="text/plain; version=0.0.4")
