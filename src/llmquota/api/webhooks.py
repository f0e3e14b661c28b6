"""Webhook HTTP: the sender the delivery loop is given, and the SSRF check of names.

The delivery loop (llmquota.admin.delivery) may not speak HTTP itself
(import-linter keeps HTTP in the adapters), so `serve` and `sweep --loop`
build a `WebhookSender` here and inject its `send`. It never follows a
redirect (a receiver could bounce us to a metadata address) and resolves
the host itself first, refusing a name that points at a link-local address
(domain.alerts.forbidden_address): the same rule the API applies to an IP
literal when the webhook is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Iterable, Mapping
from urllib.parse import urlsplit

import httpx

from llmquota.admin.delivery import DeliveryLimits, DeliveryLoop
from llmquota.config import Settings
from llmquota.domain.alerts import SendResult, check_webhook_url, forbidden_address
from llmquota.domain.errors import InvalidRequest
from llmquota.metrics import Metrics
from llmquota.store.alerts import AlertStore

# A receiver's name that does not resolve within this long is checked again at delivery.
RESOLVE_TIMEOUT_SECONDS = 2.0


async def resolved_addresses(host: str, timeout_seconds: float) -> list[str]:
    """The addresses `host` resolves to now; empty when it does not (in time)."""
    try:
        infos = await asyncio.wait_for(
            asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM),
            timeout_seconds,
        )
    except (OSError, TimeoutError):
        return []
    return sorted({str(info[4][0]) for info in infos})


async def check_webhook_target(url: object, own: Iterable[tuple[str, int]]) -> str:
    """check_webhook_url, then the same checks on the addresses a host name has now."""
    own = list(own)
    checked = check_webhook_url(url, own)
    parts = urlsplit(checked)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    if forbidden_address(host) is None:
        for address in await resolved_addresses(host, RESOLVE_TIMEOUT_SECONDS):
            if forbidden_address(address) is not None:
                raise InvalidRequest(f"url: {host} resolves to link-local {address}, refused")
            check_webhook_url(f"{parts.scheme}://{_bracketed(address)}:{port}/", own)
    return checked


def _bracketed(address: str) -> str:
    return f"[{address}]" if ":" in address else address


class WebhookSender:
    """POSTs alert bodies with one pooled client; `send` is the loop's Sender."""

    def __init__(self, max_connections: int = 20) -> None:
        self._client = httpx.AsyncClient(
            follow_redirects=False,
            limits=httpx.Limits(max_connections=max_connections),
            trust_env=False,
        )

    async def send(
        self, url: str, body: bytes, headers: Mapping[str, str], timeout_seconds: float
    ) -> SendResult:
        """One POST; delivered on any 2xx, else the status or the error."""
        host = urlsplit(url).hostname or ""
        for address in await resolved_addresses(host, timeout_seconds):
            problem = forbidden_address(address)
            if problem is not None:
                return SendResult(delivered=False, error=f"refused: {problem}")
        try:
            response = await self._client.post(
                url, content=body, headers=dict(headers), timeout=timeout_seconds
            )
        except httpx.HTTPError as exc:
            return SendResult(delivered=False, error=f"{type(exc).__name__}: {exc}"[:500])
        if 200 <= response.status_code < 300:
            return SendResult(delivered=True, status=response.status_code)
        return SendResult(
            delivered=False, status=response.status_code, error=f"HTTP {response.status_code}"
        )

    async def close(self) -> None:
        await self._client.aclose()


@contextlib.asynccontextmanager
async def delivery_running(
    store: AlertStore, settings: Settings, metrics: Metrics | None = None
) -> AsyncIterator[DeliveryLoop | None]:
    """Run the delivery loop in the background for the block (when the settings
    say so), with a sender of its own; stop it and close the sender after."""
    if not settings.alert_delivery:
        yield None
        return
    sender = WebhookSender(max_connections=settings.alert_delivery_batch_size)
    loop = DeliveryLoop(
        store,
        sender.send,
        DeliveryLimits(
            batch_size=settings.alert_delivery_batch_size,
            claim_seconds=settings.alert_delivery_claim_seconds,
            timeout_seconds=settings.alert_delivery_timeout_seconds,
            interval_seconds=settings.alert_delivery_interval_seconds,
        ),
        metrics,
    )
    stop = asyncio.Event()
    task = asyncio.create_task(loop.run(stop), name="llmquota-alert-delivery")
    try:
        yield loop
    finally:
        stop.set()
        try:
            await asyncio.wait_for(task, settings.alert_delivery_timeout_seconds + 1.0)
        except TimeoutError:
            pass  # cancelled by wait_for: an unrecorded send is sent again later
        finally:
            await sender.close()
