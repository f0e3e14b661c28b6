"""The REST endpoints, one module per resource group, behind one router.

Each module holds the routes of one thing a client or an operator acts on
(operations, admission, policies, plans and ceilings, tenants, keys, quotas, webhooks), so
that a change to one contract
reads and reviews on its own. Paths, fields and status codes are a contract
with clients; see README.md. The app includes `router` and nothing else.
"""

from __future__ import annotations

from fastapi import APIRouter

from llmquota.api.dependencies import error_responses
from llmquota.api.routes import (
    admission,
    key_quotas,
    keys,
    operations,
    plans,
    policies,
    policy_patch,
    quotas,
    tenant_directory,
    tenants,
    webhooks,
)

# Every endpoint may answer these: parsing, authentication (429: a client out of its
# failed-authentication budget, or a full fair-share queue), body size, validation, outage.
router = APIRouter(responses=error_responses(400, 401, 403, 404, 413, 422, 429, 503))
# The order of the OpenAPI document's paths.
for _group in (
    operations,
    admission,
    policies,
    policy_patch,
    plans,
    tenants,
    tenant_directory,
    keys,
    quotas,
    key_quotas,
    webhooks,
):
    router.include_router(_group.router)

__all__ = ["router"]
