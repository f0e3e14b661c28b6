"""Proxy mode: llmquota in front of the provider, speaking the provider's wire format.

With an upstream configured (LLMQUOTA_OPENAI_BASE_URL and _API_KEY,
LLMQUOTA_ANTHROPIC_BASE_URL and _API_KEY), clients point the official SDKs at
llmquota instead of calling /v1/admit and /settle themselves: every call is
admitted, forwarded with the provider key (which never reaches a client) and
settled from the provider's own usage. An adapter beside the REST API, in the
API layer: it uses the Limiter exactly as the /v1/admit route does.
"""

from __future__ import annotations

from llmquota.api.proxy.routes import proxy_router
from llmquota.api.proxy.upstream import Proxy

__all__ = ["Proxy", "proxy_router"]
