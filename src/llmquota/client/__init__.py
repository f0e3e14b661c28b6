"""A client of llmquota's REST API: the library's reservation API, over HTTP.

```python
from llmquota.client import AsyncClient, RateLimited

async with AsyncClient("http://llmquota:8080", key) as limiter:
    async with limiter.reservation(tenant="acme", model="gpt-4o",
                                   messages=messages, max_tokens=2000) as r:
        ...
        await r.settle(input_tokens=..., output_tokens=...)
```

`Client` is the same, blocking. The exceptions are the library's
(llmquota.domain.errors, re-exported here), so `except RateLimited` catches
a refusal whichever way it came; errors.py adds those only HTTP has. This package
talks HTTP only: it imports the domain and httpx, never the services or the
store (pyproject's import-linter contracts), and needs no database.
"""

from llmquota.client.asynchronous import AsyncClient, AsyncRemoteReservation
from llmquota.client.errors import (
    AuthenticationFailed,
    LimiterUnreachable,
    PermissionDenied,
    UnexpectedResponse,
)
from llmquota.client.sync import Client, RemoteReservation
from llmquota.client.wire import AdmitFields, Admitted
from llmquota.domain.errors import (
    CreditsExhausted,
    IdempotencyConflict,
    InvalidRequest,
    LimiterError,
    QuotaExceeded,
    RateLimited,
    RequestTooLarge,
    ReservationConflict,
    ReservationNotFound,
    StoreUnavailable,
    UnknownTenant,
    UnpricedModel,
)
from llmquota.domain.settlement import Settlement

__all__ = [
    "AdmitFields",
    "Admitted",
    "AsyncClient",
    "AsyncRemoteReservation",
    "AuthenticationFailed",
    "Client",
    "CreditsExhausted",
    "IdempotencyConflict",
    "InvalidRequest",
    "LimiterError",
    "LimiterUnreachable",
    "PermissionDenied",
    "QuotaExceeded",
    "RateLimited",
    "RemoteReservation",
    "RequestTooLarge",
    "ReservationConflict",
    "ReservationNotFound",
    "Settlement",
    "StoreUnavailable",
    "UnexpectedResponse",
    "UnknownTenant",
    "UnpricedModel",
]
