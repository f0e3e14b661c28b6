"""The asyncio REST client: `AsyncClient`, and the reservations it holds.

sync.py's twin, line for line, with awaits: the library's reservation API
(admission/limiter.py) over HTTP. A block left without settling releases
its reservation, also when the task is cancelled (the release is shielded,
so a cancelled caller still returns its capacity, as the library does).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any, Unpack

import httpx

from llmquota.client.errors import LimiterUnreachable, error_of
from llmquota.client.held import Held, released_anyway
from llmquota.client.retrying import (
    DEFAULT_MAX_RETRIES,
    DEFAULT_TIMEOUT_SECONDS,
    Retrying,
    check_max_retries,
)
from llmquota.client.wire import (
    ADMIT_PATH,
    AdmitFields,
    Admitted,
    Answer,
    admit_body,
    check_max_wait_ms,
    heartbeat_body,
    lease_of,
    reservation_path,
    settle_body,
    settlement_of,
)
from llmquota.domain.errors import (
    LimiterError,
    ReservationConflict,
    ReservationNotFound,
    UnknownTenant,
)
from llmquota.domain.settlement import Settlement
from llmquota.domain.vocabulary import Outcome


class AsyncRemoteReservation(Held):
    """Admitted capacity held on the server until settled, released or expired."""

    def __init__(self, client: AsyncClient, tenant: str, admitted: Admitted) -> None:
        super().__init__(tenant, admitted)
        self._client = client

    async def settle(
        self, *, input_tokens: int, output_tokens: int, outcome: Outcome = "ok"
    ) -> Settlement:
        """Charge what the provider reported; refund (or debit) the difference."""
        self.settlement = await self._client.settle(
            self.reservation_id,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            outcome=outcome,
        )
        return self.settlement

    async def release(self) -> None:
        """Give everything back: the provider was never called."""
        await self._client.release(self.reservation_id)
        self.released = True

    async def heartbeat(self, lease_seconds: int | None = None) -> datetime:
        """Extend the lease while the work is healthy; the new expiry."""
        self.lease_expires_at, self.lease_generation = await self._client.heartbeat(
            self.reservation_id, lease_seconds
        )
        return self.lease_expires_at


class AsyncClient:
    """llmquota's admission API over HTTP, for asyncio; an async context manager.

    `key`: a tenant's key (or the admin key). `transport`: an httpx transport
    to send through (a proxy's, a test's); httpx's own by default.
    """

    def __init__(
        self,
        base_url: str,
        key: str,
        *,
        timeout: float = DEFAULT_TIMEOUT_SECONDS,
        max_retries: int = DEFAULT_MAX_RETRIES,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.max_retries = check_max_retries(max_retries)
        self._http = httpx.AsyncClient(
            base_url=base_url,
            headers={"Authorization": f"Bearer {key}"},
            timeout=timeout,
            transport=transport,
        )

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def admit(
        self, *, max_wait_ms: int = 0, **fields: Unpack[AdmitFields]
    ) -> AsyncRemoteReservation:
        """Reserve capacity for one request, or raise why not (the library's exceptions).

        `max_wait_ms`: wait up to that long in all for room, at the server's
        hints, rather than raise RateLimited at once.
        """
        body = admit_body(fields, generate_key=self.max_retries > 0)
        answer = await self._call(ADMIT_PATH, body, check_max_wait_ms(max_wait_ms), UnknownTenant)
        return AsyncRemoteReservation(self, fields["tenant"], Admitted.of(answer))

    @contextlib.asynccontextmanager
    async def reservation(
        self, *, max_wait_ms: int = 0, **fields: Unpack[AdmitFields]
    ) -> AsyncIterator[AsyncRemoteReservation]:
        """Hold a reservation for a block; leaving it unsettled releases it (on an
        exception or cancellation too)."""
        held = await self.admit(max_wait_ms=max_wait_ms, **fields)
        try:
            yield held
        finally:
            if not held.finished:
                try:
                    await asyncio.shield(held.release())
                except ReservationConflict as exc:
                    if not released_anyway(exc):
                        raise
                    held.released = True

    async def settle(
        self,
        reservation_id: uuid.UUID,
        *,
        input_tokens: int,
        output_tokens: int,
        outcome: Outcome = "ok",
    ) -> Settlement:
        """Charge actual usage for a reservation; idempotent for the same figures."""
        path = reservation_path(reservation_id, "settle")
        body = settle_body(input_tokens, output_tokens, outcome)
        return settlement_of(await self._call(path, body))

    async def release(self, reservation_id: uuid.UUID) -> None:
        """Return a reservation unused; idempotent."""
        await self._call(reservation_path(reservation_id, "release"), None)

    async def heartbeat(
        self, reservation_id: uuid.UUID, lease_seconds: int | None = None
    ) -> tuple[datetime, int]:
        """Extend a live lease: (its new expiry, its lease generation)."""
        path = reservation_path(reservation_id, "heartbeat")
        return lease_of(await self._call(path, heartbeat_body(lease_seconds)))

    async def _call(
        self,
        path: str,
        body: dict[str, Any] | None,
        max_wait_ms: int = 0,
        not_found: type[LimiterError] = ReservationNotFound,
    ) -> dict[str, Any]:
        """POST until an answer stands (retrying.py); the 2xx body, or raise its error."""
        retrying = Retrying(max_wait_ms, self.max_retries, time.monotonic)
        while True:
            try:
                response = await self._http.post(path, json=body)
            except httpx.TransportError as exc:
                delay = retrying.after_failure()
                if delay is None:
                    raise LimiterUnreachable(f"POST {path}: {exc!r}") from exc
            else:
                answer = Answer(response.status_code, response.headers, response.text)
                if answer.ok:
                    return answer.body
                delay = retrying.after_refusal(answer)
                if delay is None:
                    raise error_of(answer, not_found)
            await asyncio.sleep(delay)
