"""The words of the domain, as typed literals: one name per concept.

Pure. Every layer of the code speaks these, so a limit kind or a scope is
checked by mypy wherever it travels, from the SQL row to the JSON body.
"""

from __future__ import annotations

from typing import Literal

# What a refusal names as the limit that bound.
LimitKind = Literal["tokens", "requests", "concurrency"]
# Which layer of the stack a limit belongs to.
Scope = Literal["global", "tenant", "route"]
SCOPES: tuple[Scope, ...] = ("global", "tenant", "route")

# What a layer does when the store cannot decide within the deadline:
#   closed  refuse (503 limiter_unavailable, never a 429);
#   open    admit, and record the admission when the store is back;
#   local   admit against a worker-local fraction of this layer's limits.
FailureMode = Literal["closed", "open", "local"]
FAILURE_MODES: tuple[FailureMode, ...] = ("closed", "open", "local")
DEFAULT_FAILURE_MODE: FailureMode = "closed"

AdmitStatus = Literal[
    "admitted", "replayed", "rate_limited", "too_large", "unknown_tenant", "idempotency_conflict"
]
FinishAction = Literal["settle", "release", "expire"]
FinishStatus = Literal[
    "settled", "released", "expired", "replayed", "conflict", "not_found", "not_due"
]
# How the provider call ended, as the caller reports it when settling.
Outcome = Literal["ok", "error", "cancelled"]
OUTCOMES: tuple[Outcome, ...] = ("ok", "error", "cancelled")
