"""The settings of what llmquota sends out: alert deliveries, and proxy mode.

A part of `Settings` (settings.py), which inherits these fields and reads
them from LLMQUOTA_* variables like every other; kept apart only so that
each module stays one page of one topic. Never built on its own.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings

from llmquota.domain.destinations import DestinationRules, parse_networks
from llmquota.domain.errors import InvalidRequest

# The longest a deployment of a model is cooled down (api/proxy/cooldown.py),
# whatever its provider's retry-after says: as long as the provider
# ceilings' cooldown may last.
MAX_DEPLOYMENT_COOLDOWN_SECONDS = 3_600.0
# The most failures in a row that may be asked for before a deployment is cooled.
MAX_DEPLOYMENT_COOLDOWN_FAILURES = 100


class OutboundSettings(BaseSettings):
    """Alert delivery, webhook destinations, the proxy's upstreams and pools."""

    # Alert delivery (llmquota.admin.delivery), in `serve` and in `sweep --loop`.
    alert_delivery: bool = Field(
        default=True,
        description="run the webhook delivery loop in this process (serve, sweep --loop)",
    )
    alert_delivery_interval_seconds: float = Field(
        default=1.0, gt=0, le=300.0, description="pause of the delivery loop when nothing is due"
    )
    alert_delivery_batch_size: int = Field(
        default=50, ge=1, le=1_000, description="deliveries one loop claims and sends at once"
    )
    alert_delivery_timeout_seconds: float = Field(
        default=10.0, gt=0, le=120.0, description="longest wait for one webhook's answer"
    )
    alert_delivery_per_destination: int = Field(
        default=4,
        ge=1,
        le=100,
        description="deliveries in flight at once to one webhook, per process: a slow receiver "
        "holds at most this many, and every other webhook's deliveries go on beside it",
    )
    webhook_allowed_networks: str = Field(
        default="",
        description="comma-separated CIDR networks (e.g. 10.0.0.0/8,fd00::/8) that webhooks may "
        "reach although they are loopback, private or otherwise not public (on-premise "
        "receivers); link-local (cloud metadata), multicast and unspecified addresses never",
    )
    serve_listen: str | None = Field(
        default=None,
        description="host:port `llmquota serve` listens on, set by serve for its workers so "
        "alert delivery refuses to POST to the service itself",
    )
    alert_delivery_claim_seconds: float = Field(
        default=60.0,
        ge=1.0,
        le=3_600.0,
        description="how long a claimed delivery is this loop's alone; after a crash it is "
        "due again then (keep it above the timeout)",
    )
    # Ceiling alerts (llmquota.admin.ceiling_alerts), in `serve` and `sweep --loop`.
    ceiling_alerts: bool = Field(
        default=True,
        description="run the provider ceilings' alert detector in this process (serve, sweep "
        "--loop): it reads their utilization and records threshold crossings in the outbox",
    )
    ceiling_alert_interval_seconds: float = Field(
        default=1.0,
        ge=0.05,
        le=60.0,
        description="how often the detector reads the ceilings' utilization (one statement) "
        "and records what crossed (one more)",
    )
    ceiling_alert_hysteresis: float = Field(
        default=0.05,
        ge=0.0,
        le=0.5,
        description="a ceiling's alert episode ends once utilization stays below the threshold "
        "minus this fraction (a ceiling's alert_hysteresis wins)",
    )
    ceiling_alert_quiet_seconds: float = Field(
        default=60.0,
        ge=0.0,
        le=86_400.0,
        description="how long a ceiling's utilization must stay below the threshold minus the "
        "hysteresis to end its alert episode; the next crossing then alerts again (a ceiling's "
        "alert_quiet_seconds wins)",
    )
    # Proxy mode (llmquota.api.proxy): each upstream needs its base URL and its key.
    openai_base_url: str | None = Field(
        default=None,
        description="OpenAI-format upstream as the openai SDK takes it, /v1 included "
        "(e.g. https://api.openai.com/v1); enables POST /v1/chat/completions",
    )
    openai_api_key: SecretStr | None = Field(
        default=None, description="the provider key sent upstream; never shown to clients"
    )
    anthropic_base_url: str | None = Field(
        default=None,
        description="Anthropic-format upstream as the anthropic SDK takes it, without /v1 "
        "(e.g. https://api.anthropic.com); enables POST /v1/messages",
    )
    anthropic_api_key: SecretStr | None = Field(
        default=None, description="the provider key sent upstream; never shown to clients"
    )
    upstreams_file: str | None = Field(
        default=None,
        description="TOML file of several upstreams and the models each serves (see "
        "llmquota.config.upstreams); read and checked at start-up",
    )
    proxy_default_max_tokens: int | None = Field(
        default=None,
        ge=1,
        le=10_000_000,
        description="output tokens reserved when a proxied request gives no max_tokens; "
        "unset: the model's maximum output from the shipped table",
    )
    proxy_count_tokens: Literal["local", "upstream"] = Field(
        default="local",
        description="POST /v1/messages/count_tokens: local (counted here as admission "
        "counts, answered in Anthropic's format) or upstream (passed to the Anthropic "
        "upstream with the provider key)",
    )
    proxy_disconnect: Literal["drain", "cancel"] = Field(
        default="drain",
        description="a client hanging up mid-stream: drain (read the provider to its final "
        "usage, bounded) or cancel (close upstream, settle output counted so far)",
    )
    proxy_drain_seconds: float = Field(
        default=120.0, gt=0, le=3_600.0, description="longest a hung-up stream is drained"
    )
    proxy_client_stall_seconds: float = Field(
        default=300.0,
        gt=0,
        le=3_600.0,
        description="a streaming client that reads nothing for this long counts as gone "
        "(drain or cancel, as for a hang-up)",
    )
    proxy_connect_timeout_seconds: float = Field(
        default=10.0, gt=0, le=600.0, description="longest wait for a connection to an upstream"
    )
    proxy_read_timeout_seconds: float = Field(
        default=600.0,
        gt=0,
        le=3_600.0,
        description="longest wait for the provider's next bytes; plus the connect timeout, "
        "also the deadline of all of a request's attempts at a model's deployments together "
        "(the longest of theirs, with an upstream's own timeouts)",
    )
    proxy_max_connections: int = Field(
        default=200,
        ge=1,
        le=100_000,
        description="pooled connections per upstream per worker (each tenant holds at most "
        "PROXY_TENANT_CONNECTION_SHARE of them)",
    )
    proxy_ceiling_cooldown_seconds: float = Field(
        default=0.0,
        ge=0,
        le=3_600.0,
        description="0: off. Otherwise an upstream 429 for a model empties the provider "
        "ceilings matching it and debits their refill for the provider's retry-after (this "
        "many seconds when it gives none), so llmquota refuses that model itself meanwhile",
    )
    proxy_deployment_cooldown_seconds: float = Field(
        default=10.0,
        ge=0,
        le=MAX_DEPLOYMENT_COOLDOWN_SECONDS,
        description="0: off. Otherwise a deployment of a model listed under several upstreams "
        "that answers 429 (for the provider's retry-after) or fails "
        "PROXY_DEPLOYMENT_COOLDOWN_FAILURES times in a row (for this many seconds) is tried "
        "after the model's other deployments meanwhile, on that worker",
    )
    proxy_deployment_cooldown_failures: int = Field(
        default=3,
        ge=1,
        le=MAX_DEPLOYMENT_COOLDOWN_FAILURES,
        description="5xx answers, failed connections or timeouts in a row that cool a "
        "deployment of a model down (a 429 cools it at once; any other answer starts the "
        "count again)",
    )
    proxy_tenant_connection_share: float = Field(
        default=0.5,
        gt=0,
        lt=1,
        description="the part of an upstream's connection pool one tenant may hold "
        "(at least one connection, never the whole pool); past it the tenant's next "
        "request is a 429 naming the reason",
    )
    proxy_pool_wait_ms: int = Field(
        default=1_000,
        ge=0,
        le=30_000,
        description="how long a request waits for a connection when an upstream's pool is "
        "full; then a 503 naming the reason",
    )
    proxy_tenant_max_drains: int = Field(
        default=8,
        ge=0,
        le=10_000,
        description="abandoned streams of one tenant drained at once per worker "
        "(PROXY_DISCONNECT=drain); past it a hang-up cancels the upstream and settles the "
        "output counted so far",
    )
    proxy_heartbeat_seconds: float = Field(
        default=20.0,
        gt=0,
        le=3_600.0,
        description="how often a running stream renews its reservation's lease",
    )

    @field_validator("webhook_allowed_networks")
    @classmethod
    def _networks_are_cidr(cls, value: str) -> str:
        try:
            parse_networks(value)
        except InvalidRequest as exc:
            raise ValueError(str(exc)) from exc
        return value

    @field_validator("serve_listen")
    @classmethod
    def _listen_is_host_port(cls, value: str | None) -> str | None:
        if value is not None:
            port = value.rpartition(":")[2]
            if not port.isdigit() or not 0 < int(port) < 65_536:
                raise ValueError("must be host:port")
        return value

    def destination_rules(self, own: Iterable[tuple[str, int]] = ()) -> DestinationRules:
        """Where webhooks may be sent: the allowed networks, and this service's own
        addresses (`own`, plus where serve listens) never."""
        listening = list(own)
        if self.serve_listen is not None:
            host, _, port = self.serve_listen.rpartition(":")
            listening.append((host, int(port)))
        return DestinationRules(parse_networks(self.webhook_allowed_networks), tuple(listening))
