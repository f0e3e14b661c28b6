"""The reference model's own arithmetic, without a database: if it were
wrong, the walk would compare the store with the wrong figures."""

from __future__ import annotations

import uuid
from decimal import Decimal

from tests.model.model import CEILING, GLOBAL, Books, Credit, Held, Layer, QuotaUse, cost


def books() -> Books:
    b = Books()
    b.layers[GLOBAL] = Layer(burst=10_000, balance=10_000.0)
    b.layers[CEILING] = Layer(burst=1_000, balance=1_000.0)
    b.layers[("tenant", "a")] = Layer(burst=5_000, balance=5_000.0)
    b.credits["a"] = Credit(balance=Decimal("1.00"))
    b.quotas["a"] = QuotaUse()
    return b


def held(b: Books, input_tokens: int, max_tokens: int, model: str = "gpt-4o") -> Held:
    h = Held(
        reservation_id=uuid.uuid4(),
        tenant="a",
        model=model,
        input_tokens=input_tokens,
        max_tokens=max_tokens,
        layers=b.layers_for("a", model),
        credit_hold=cost(model, input_tokens, max_tokens),
    )
    b.admit(h)
    return h


def balances(b: Books) -> tuple[float, float, float]:
    return (
        b.layers[GLOBAL].balance,
        b.layers[CEILING].balance,
        b.layers[("tenant", "a")].balance,
    )


def test_an_on_time_settlement_refunds_the_rest_and_charges_the_cost() -> None:
    b = books()
    h = held(b, 100, 400)  # 500 reserved, $0.00425 held
    assert balances(b) == (9_500.0, 500.0, 4_500.0)
    assert (b.credits["a"].reserved, b.quotas["a"].reserved) == (Decimal("0.00425"), 500)
    assert b.settle(h, 100, 150) == "settled"
    assert balances(b) == (9_750.0, 750.0, 4_750.0)
    assert b.credits["a"] == Credit(balance=Decimal("0.99825"), reserved=Decimal(0))
    assert b.quotas["a"] == QuotaUse(reserved=0, charged=250)
    assert (b.ledger_rows, b.ledger_input, b.ledger_output) == (1, 100, 150)
    assert b.settle(h, 100, 150) == "replayed" and b.settle(h, 1, 1) == "conflict"


def test_the_global_layer_takes_at_most_the_cap_and_shared_layers_stop_at_minus_burst() -> None:
    b = books()
    h = held(b, 100, 400)  # cap: ceil(125) + 64 + 400 = 589
    assert b.settle(h, 0, 100_000) == "settled"
    # global: 9,500 + 500 - 589; the ceiling floored at -1,000; the tenant in full
    assert balances(b) == (9_411.0, -1_000.0, 5_000.0 - 100_000)


def test_release_and_expiry_give_everything_back_and_a_late_settle_debits_its_use() -> None:
    b = books()
    released, expired = held(b, 10, 90), held(b, 0, 300)
    b.give_back(released, expired=False)
    b.give_back(expired, expired=True)
    assert balances(b) == (10_000.0, 1_000.0, 5_000.0)  # clamped at capacity
    assert b.ledger_rows == 1 and expired.ledger == [("usage", 0, 0, "expired")]
    assert b.settle(expired, 0, 200) == "late"
    assert balances(b) == (9_800.0, 800.0, 4_800.0)
    assert b.credits["a"].balance == Decimal("1.00") - Decimal("0.002")
    assert b.quotas["a"] == QuotaUse(reserved=0, charged=200)
    assert b.settle(released, 1, 1) == "conflict"


def test_an_outage_admission_is_debited_without_a_limit_check_but_floored_when_shared() -> None:
    b = books()
    h = Held(uuid.uuid4(), "a", "gpt-4o", 0, 2_500, b.layers_for("a", "gpt-4o"), None, True)
    b.record_outage(h)
    assert balances(b) == (7_500.0, -1_000.0, 2_500.0)
    assert [b.layers[k].in_flight for k in h.layers] == [1, 1, 1]


def test_a_policy_change_clamps_and_a_refill_fills() -> None:
    b = books()
    held(b, 0, 4_000, model="gpt-4o-mini")  # not a ceiling model
    assert balances(b) == (6_000.0, 1_000.0, 1_000.0)
    b.set_burst(GLOBAL, 5_000)
    b.set_burst(("tenant", "a"), 500)
    assert balances(b) == (5_000.0, 1_000.0, 500.0)
    b.refill_all()
    assert balances(b) == (5_000.0, 1_000.0, 500.0)
