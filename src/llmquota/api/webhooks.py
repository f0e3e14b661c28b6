"""Webhook HTTP: the sender the delivery loop is given, and the address checks of URLs.

The delivery loop (llmquota.admin.delivery) may not speak HTTP itself
(import-linter keeps HTTP in the adapters), so `serve` and `sweep --loop`
build a `WebhookSender` here and inject its `send`.

SSRF: the rules of where a delivery may go are domain.destinations'. A URL
is checked when it is set (an address or a name of this machine at once, a
name's addresses as they resolve then) and again at every delivery, where
the host is resolved once, every address it resolves to is checked, and the
connection goes to the checked address (the TLS name and Host header stay
the URL's): a name that resolved to a public address at registration and
resolves to a private one now (DNS rebinding) is refused, and no second
lookup happens between the check and the connect. Redirects are never
followed (a receiver could bounce us to a metadata address).

Bounds: one attempt, connect to the end of the answer, takes at most the
delivery timeout; at most MAX_RESPONSE_BYTES of an answer are read and the
connection is closed on the rest, so no receiver can hold a delivery longer
or make the server hold its body.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from urllib.parse import urlsplit, urlunsplit

import httpx

from llmquota.admin.delivery import DeliveryLimits, DeliveryLoop
from llmquota.config import Settings
from llmquota.domain.alerts import SendResult, check_webhook_url
from llmquota.domain.destinations import (
    DestinationRules,
    connect_problem,
    is_loopback_name,
    literal_address,
    normalise_host,
)
from llmquota.domain.errors import InvalidRequest
from llmquota.metrics import Metrics
from llmquota.store.alerts import AlertStore

# A receiver's name that does not resolve within this long is checked again at delivery.
RESOLVE_TIMEOUT_SECONDS = 2.0
# What is read of a receiver's answer: the status is all a delivery needs; the
# rest of a larger body is dropped with the connection.
MAX_RESPONSE_BYTES = 64 * 1024

# host, timeout in seconds -> the addresses it resolves to now (empty: none in time).
Resolver = Callable[[str, float], Awaitable[list[str]]]


async def resolved_addresses(host: str, timeout_seconds: float) -> list[str]:
    """The addresses `host` resolves to now; empty when it does not (in time)."""
    try:
        infos = await asyncio.wait_for(
            asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM),
            timeout_seconds,
        )
    except (OSError, TimeoutError, UnicodeError):  # UnicodeError: a name IDNA refuses
        return []
    return sorted({str(info[4][0]) for info in infos})


def _port(scheme: str, port: int | None) -> int:
    return port if port is not None else (443 if scheme == "https" else 80)


async def check_webhook_target(
    url: object, rules: DestinationRules, resolve: Resolver = resolved_addresses
) -> str:
    """check_webhook_url, then the same rules on the addresses a host name has now
    (a name that does not resolve yet is checked at delivery)."""
    checked = check_webhook_url(url, rules)
    parts = urlsplit(checked)
    host = parts.hostname or ""
    if literal_address(host) is None and not is_loopback_name(host):
        addresses = await resolve(normalise_host(host), RESOLVE_TIMEOUT_SECONDS)
        if addresses:
            problem = connect_problem(host, _port(parts.scheme, parts.port), addresses, rules)
            if problem is not None:
                raise InvalidRequest(f"url: {host} resolves to {problem}, refused")
    return checked


def _bracketed(address: str) -> str:
    return f"[{address}]" if ":" in address else address


class WebhookSender:
    """POSTs alert bodies with one pooled client; `send` is the loop's Sender."""

    def __init__(
        self,
        rules: DestinationRules,
        max_connections: int = 20,
        resolve: Resolver = resolved_addresses,
    ) -> None:
        self._rules = rules
        self._resolve = resolve
        self._client = httpx.AsyncClient(
            follow_redirects=False,
            limits=httpx.Limits(max_connections=max_connections),
            trust_env=False,
        )

    async def send(
        self, url: str, body: bytes, headers: Mapping[str, str], timeout_seconds: float
    ) -> SendResult:
        """One POST, all of it within `timeout_seconds`; delivered on any 2xx, else
        the status or the error."""
        try:
            async with asyncio.timeout(timeout_seconds):
                return await self._post(url, body, headers, timeout_seconds)
        except TimeoutError:
            return SendResult(delivered=False, error=f"no whole answer within {timeout_seconds} s")
        except httpx.HTTPError as exc:
            return SendResult(delivered=False, error=f"{type(exc).__name__}: {exc}"[:500])

    async def _post(
        self, url: str, body: bytes, headers: Mapping[str, str], timeout_seconds: float
    ) -> SendResult:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = _port(parts.scheme, parts.port)
        literal = literal_address(host)
        if literal is not None:
            addresses = [str(literal)]
        else:
            addresses = await self._resolve(normalise_host(host), timeout_seconds)
        problem = connect_problem(host, port, addresses, self._rules)
        if problem is not None:
            return SendResult(delivered=False, error=f"refused: {problem}")
        # Connect to the address just checked, never to a second lookup's answer.
        target = urlunsplit(
            (parts.scheme, f"{_bracketed(addresses[0])}:{port}", parts.path or "/", parts.query, "")
        )
        sent = {**headers, "host": parts.netloc.rpartition("@")[2]}
        extensions = {"sni_hostname": normalise_host(host)} if literal is None else {}
        auth = (parts.username or "", parts.password or "") if parts.username else None
        request = self._client.build_request(
            "POST",
            target,
            content=body,
            headers=sent,
            extensions=extensions,
            timeout=timeout_seconds,
        )
        response = await self._client.send(request, stream=True, auth=auth)
        try:
            read = 0
            async for chunk in response.aiter_raw():
                read += len(chunk)
                if read >= MAX_RESPONSE_BYTES:
                    break  # the rest goes with the connection, which aclose drops
        finally:
            await response.aclose()
        if 200 <= response.status_code < 300:
            return SendResult(delivered=True, status=response.status_code)
        return SendResult(
            delivered=False, status=response.status_code, error=f"HTTP {response.status_code}"
        )

    async def close(self) -> None:
        await self._client.aclose()


def this_machine(port: int) -> list[tuple[str, int]]:
    """This host's own addresses at `port` (best effort: what its name resolves to)."""
    with contextlib.suppress(OSError):
        infos = socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM)
        return sorted({(str(info[4][0]), port) for info in infos})
    return []


@contextlib.asynccontextmanager
async def delivery_running(
    store: AlertStore, settings: Settings, metrics: Metrics | None = None
) -> AsyncIterator[DeliveryLoop | None]:
    """Run the delivery loop in the background for the block (when the settings
    say so), with a sender of its own; stop it and close the sender after."""
    if not settings.alert_delivery:
        yield None
        return
    ports = {port for _, port in settings.destination_rules().own}
    rules = settings.destination_rules([pair for port in ports for pair in this_machine(port)])
    sender = WebhookSender(rules, max_connections=settings.alert_delivery_batch_size)
    loop = DeliveryLoop(
        store,
        sender.send,
        DeliveryLimits(
            batch_size=settings.alert_delivery_batch_size,
            claim_seconds=settings.alert_delivery_claim_seconds,
            timeout_seconds=settings.alert_delivery_timeout_seconds,
            interval_seconds=settings.alert_delivery_interval_seconds,
            per_destination=settings.alert_delivery_per_destination,
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
