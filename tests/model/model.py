"""The reference model: what every layer, credit account and quota must hold.

Plain Python, no I/O. It is given what the database decided (admitted or
refused, which reservation was settled with what) and applies the rules the
system promises, so the harness can compare the books after every step:

- admission reserves input + max_tokens on every layer it passes, a prepaid
  tenant's maximum cost on its credits and the tokens on its daily quota;
- an on-time settlement refunds reserved - actual, clamped at capacity (or
  debits the excess); shared layers (global, ceiling) take at most the
  shared-charge cap (global) and never go below minus their burst;
- release and expiry give the whole reservation back, a late settlement
  debits what was used; credits charge the actual cost, quotas the tokens;
- usage admitted by a failure mode during an outage is billed like any other
  when the journal is replayed (credits, quota, ceiling included);
- a request made with t0's limited API key passes that key's layer too
  (KEY), and is held, refunded and given back there like anywhere else;
- a call of a tenant whose policy says `uses_concurrency: false` takes no
  permit on any layer, and its finish frees none, whatever the policy says
  by then (the reservation keeps what it took: `permits`).

Refill is the one thing the model cannot know to the token while the clock
runs, so layers refill at 1 token a minute and the harness compares with a
tolerance of exactly what that rate allows for the time between two checks
(computed from the database clock), then anchors the model to the database.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field
from decimal import Decimal

# gpt-4o and gpt-4o-mini at these prices per million tokens (in, out).
PRICES: dict[str, tuple[Decimal, Decimal]] = {
    "gpt-4o": (Decimal("2.50"), Decimal("10.00")),
    "gpt-4o-mini": (Decimal("0.15"), Decimal("0.60")),
}
CEILING_MODELS = ("gpt-4o",)

LayerKey = tuple[str, str]  # ("global", ""), ("tenant", name), ("ceiling", name), ("key", tenant)
GLOBAL: LayerKey = ("global", "")
CEILING: LayerKey = ("ceiling", "provider")
KEY: LayerKey = ("key", "t0")  # the one API key with limits of its own: t0's
SHARED_SCOPES = ("global", "ceiling")


def cost(model: str, input_tokens: int, output_tokens: int) -> Decimal:
    """What usage costs, as lq_cost computes it."""
    price_in, price_out = PRICES[model]
    return (input_tokens * price_in + output_tokens * price_out) / 1_000_000


def shared_charge_cap(input_tokens: int, max_tokens: int) -> int:
    """lq_shared_charge_cap: the most one settlement takes from the global layer."""
    return math.ceil(input_tokens * 1.25) + 64 + max_tokens


@dataclass
class Layer:
    burst: int
    balance: float
    in_flight: int = 0


@dataclass
class Held:
    """One reservation as the model knows it."""

    reservation_id: uuid.UUID
    tenant: str
    model: str
    input_tokens: int
    max_tokens: int
    layers: tuple[LayerKey, ...]
    credit_hold: Decimal | None
    outage: bool = False
    permits: int = 1  # 0: its tenant's policy said uses_concurrency false when admitted
    state: str = "active"  # active | settled | released | expired
    usage: tuple[int, int] | None = None
    late: bool = False
    # the ledger rows it must have: (entry_kind, input, output, outcome)
    ledger: list[tuple[str, int, int, str]] = field(default_factory=list)

    @property
    def reserved(self) -> int:
        return self.input_tokens + self.max_tokens


@dataclass
class Credit:
    balance: Decimal = Decimal(0)
    reserved: Decimal = Decimal(0)


@dataclass
class QuotaUse:
    reserved: int = 0
    charged: int = 0


class Books:
    """The expected state of every layer, credit account and quota."""

    def __init__(self) -> None:
        self.layers: dict[LayerKey, Layer] = {}
        self.held: dict[uuid.UUID, Held] = {}
        self.credits: dict[str, Credit] = {}
        self.quotas: dict[str, QuotaUse] = {}
        self.ledger_rows = 0
        self.ledger_input = 0
        self.ledger_output = 0

    # -- layer arithmetic ------------------------------------------------------
    def _credit(self, key: LayerKey, tokens: float) -> None:
        """Add (or take) tokens: never above capacity; shared layers never below -burst."""
        layer = self.layers[key]
        balance = min(float(layer.burst), layer.balance + tokens)
        if key[0] in SHARED_SCOPES:
            balance = max(-float(layer.burst), balance)
        layer.balance = balance

    def layers_for(self, tenant: str, model: str, keyed: bool = False) -> tuple[LayerKey, ...]:
        ceiling = (CEILING,) if model in CEILING_MODELS and CEILING in self.layers else ()
        key = (KEY,) if keyed else ()
        return (GLOBAL, ("tenant", tenant), *ceiling, *key)

    def fits(self, layers: tuple[LayerKey, ...], tokens: int, tolerance: float) -> bool:
        """Whether every layer had room for `tokens` (give or take the refill)."""
        return all(self.layers[k].balance + tolerance >= tokens for k in layers)

    # -- transitions -------------------------------------------------------------
    def admit(self, held: Held) -> None:
        """An admission decided by the store: the holds, with the limit check passed."""
        self.held[held.reservation_id] = held
        for key in held.layers:
            self.layers[key].balance -= held.reserved
            self.layers[key].in_flight += held.permits
        self._hold_budgets(held)

    def record_outage(self, held: Held) -> None:
        """A failure mode's admission, written when the store is back: debited with no
        limit check (shared layers still floored at -burst)."""
        self.held[held.reservation_id] = held
        for key in held.layers:
            self._credit(key, -held.reserved)
            self.layers[key].in_flight += held.permits
        self._hold_budgets(held)

    def _hold_budgets(self, held: Held) -> None:
        if held.credit_hold is not None:
            self.credits[held.tenant].reserved += held.credit_hold
        self.quotas[held.tenant].reserved += held.reserved

    def _give_back_budgets(self, held: Held) -> None:
        if held.credit_hold is not None:
            self.credits[held.tenant].reserved -= held.credit_hold
        self.quotas[held.tenant].reserved -= held.reserved

    def _charge_budgets(self, held: Held, input_tokens: int, output_tokens: int) -> None:
        if held.credit_hold is not None:
            self.credits[held.tenant].balance -= cost(held.model, input_tokens, output_tokens)
        self.quotas[held.tenant].charged += input_tokens + output_tokens
        self.ledger_input += input_tokens
        self.ledger_output += output_tokens

    def settle(self, held: Held, input_tokens: int, output_tokens: int) -> str:
        """Settle a reservation; 'settled' (on time), 'late', 'replayed' or 'conflict'."""
        charged = input_tokens + output_tokens
        if held.usage is not None:
            return "replayed" if held.usage == (input_tokens, output_tokens) else "conflict"
        if held.state == "released":
            return "conflict"
        cap = shared_charge_cap(held.input_tokens, held.max_tokens)
        if held.state == "active":
            for key in held.layers:
                used = min(charged, cap) if key == GLOBAL else charged
                self._credit(key, held.reserved - used)
                self.layers[key].in_flight -= held.permits
            self._give_back_budgets(held)
            self._charge_budgets(held, input_tokens, output_tokens)
            held.state = "settled"
            held.ledger.append(("usage", input_tokens, output_tokens, "ok"))
        else:  # expired: the expiry gave it all back; debit what was used
            for key in held.layers:
                self._credit(key, -(min(charged, cap) if key == GLOBAL else charged))
            self._charge_budgets(held, input_tokens, output_tokens)
            held.late = True
            held.ledger.append(("late", input_tokens, output_tokens, "late"))
        self.ledger_rows += 1
        held.usage = (input_tokens, output_tokens)
        return "late" if held.late else "settled"

    def give_back(self, held: Held, expired: bool) -> None:
        """Release (or expire) an active reservation: everything it held comes back."""
        assert held.state == "active", held
        for key in held.layers:
            self._credit(key, held.reserved)
            self.layers[key].in_flight -= held.permits
        self._give_back_budgets(held)
        held.state = "expired" if expired else "released"
        if expired:
            held.ledger.append(("usage", 0, 0, "expired"))
            self.ledger_rows += 1

    def set_burst(self, key: LayerKey, burst: int) -> None:
        """A policy change: the balance clamped to the new capacity (lq_rebalanced)."""
        layer = self.layers[key]
        layer.burst = burst
        layer.balance = min(float(burst), layer.balance)

    def refill_all(self) -> None:
        """Time enough passed for every bucket to be full again."""
        for layer in self.layers.values():
            layer.balance = float(layer.burst)

    def top_up(self, tenant: str, amount: Decimal) -> None:
        self.credits[tenant].balance += amount

    def active(self) -> list[Held]:
        return [h for h in self.held.values() if h.state == "active"]
