"""Invariants, checked by machine: hypothesis drives random sequences of
admit, settle, release, heartbeat, sweep and clock advance against the real
database, keeps a small reference model, and checks after every step:

- every balance lies within [-(debt the model allows), capacity];
- every layer's in-flight count equals its active reservations (model and
  database alike), and lq_audit() finds no drift;
- each reservation's reserved, charged and refunded figures add up;
- a refused request changed no balance (beyond the refill time brought).

Time is advanced by moving refilled_at and lease_expires_at back in the
database, so the SQL sees minutes pass in milliseconds. Leases and steps are
multiples of 30 s, so no lease ever runs out during the few milliseconds a
step takes, and the model knows exactly which leases have lapsed.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar

import asyncpg
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    rule,
    run_state_machine_as_test,
)

from llmquota.admission.limiter import Limiter
from llmquota.domain.errors import RateLimited, RequestTooLarge, ReservationConflict
from tests.conftest import _admin, audit_findings, dsn_with_database
from tests.faults.conftest import fault_settings, put

TENANT_BURST = 1_000
ROUTE_BURST = 600
TENANT_IN_FLIGHT = 4
ROUTE_IN_FLIGHT = 2
REQUEST_BURST = 20
STEP_SECONDS = 30


@dataclass
class ModelReservation:
    """What the reference model knows about one reservation."""

    reservation_id: uuid.UUID
    route: str | None
    reserved: int
    lease_seconds: int
    lease_left_seconds: int
    state: str = "active"
    charged: int | None = None
    late: bool = False


def event(name: str) -> None:
    AdmissionMachine.tally[name] += 1


class AdmissionMachine(RuleBasedStateMachine):
    server_dsn: str = ""
    template: str = ""
    # What the runs exercised, for the report (and to prove they did).
    tally: ClassVar[Counter[str]] = Counter()

    reservations = Bundle("reservations")

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.name = f"llmquota_machine_{time.time_ns()}"
        self.run(
            _admin(self.server_dsn, f'CREATE DATABASE "{self.name}" TEMPLATE "{self.template}"')
        )
        self.dsn = dsn_with_database(self.server_dsn, self.name)
        self.limiter: Limiter = self.run(
            Limiter.connect(self.dsn, fault_settings(decision_deadline_ms=30_000))
        )
        self.db: asyncpg.Connection = self.run(asyncpg.connect(self.dsn))
        self.model: dict[uuid.UUID, ModelReservation] = {}
        self.debt_allowed = 0.0

    def run(self, coroutine: Any) -> Any:
        return self.loop.run_until_complete(coroutine)

    def teardown(self) -> None:
        self.run(self.db.close())
        self.run(self.limiter.close())
        self.run(_admin(self.server_dsn, f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)'))
        self.loop.close()

    @initialize()
    def policies(self) -> None:
        # A token a second; 1,000 tokens and 20 requests of capacity, 4 in flight;
        # the route "chat" tighter still.
        self.run(
            put(
                self.limiter,
                "tenant",
                "acme",
                tokens_per_minute=60,
                token_burst=TENANT_BURST,
                requests_per_minute=60,
                request_burst=REQUEST_BURST,
                max_in_flight=TENANT_IN_FLIGHT,
            )
        )
        self.run(
            put(
                self.limiter,
                "route",
                "acme",
                "chat",
                tokens_per_minute=60,
                token_burst=ROUTE_BURST,
                max_in_flight=ROUTE_IN_FLIGHT,
            )
        )

    # -- helpers ------------------------------------------------------------

    async def _balances(self) -> dict[str, Any]:
        rows = await self.db.fetch(
            """SELECT coalesce(route, '-') AS layer, in_flight,
                      lq_refilled(tokens, tokens_per_minute, token_burst, refilled_at, t.now)
                          AS tokens,
                      lq_refilled(requests, requests_per_minute, request_burst, refilled_at,
                                  t.now) AS requests,
                      t.now
                 FROM limit_layers, (SELECT clock_timestamp() AS now) AS t
                WHERE tenant = 'acme'"""
        )
        return {row["layer"]: dict(row) for row in rows}

    def _active(self, route: str | None = None) -> int:
        return sum(
            1
            for r in self.model.values()
            if r.state == "active" and (route is None or r.route == route)
        )

    def _lapsed(self, r: ModelReservation) -> bool:
        return r.state == "active" and r.lease_left_seconds <= 0

    # -- rules ----------------------------------------------------------------

    @rule(
        target=reservations,
        input_tokens=st.integers(0, 100),
        # mostly fitting, now and then too large for the route or the tenant
        max_tokens=st.one_of(*[st.integers(0, 300)] * 4, st.integers(500, 1_100)),
        route=st.sampled_from([None, "chat"]),
        lease_seconds=st.sampled_from([30, 60, 120, 240]),
    )
    def admit(
        self, input_tokens: int, max_tokens: int, route: str | None, lease_seconds: int
    ) -> Any:
        before = self.run(self._balances())
        cost = input_tokens + max_tokens
        try:
            r = self.run(
                self.limiter.admit(
                    tenant="acme",
                    route=route,
                    model="m",
                    input_tokens=input_tokens,
                    max_tokens=max_tokens,
                    lease_seconds=lease_seconds,
                )
            )
        except (RateLimited, RequestTooLarge) as refusal:
            event(f"admit: {getattr(refusal, 'limit', '')} {type(refusal).__name__}")
            after = self.run(self._balances())
            self._check_unchanged(before, after)
            capacity = ROUTE_BURST if route else TENANT_BURST
            if isinstance(refusal, RequestTooLarge):
                assert cost > min(capacity, TENANT_BURST)
            else:
                assert cost <= capacity
                if refusal.limit == "concurrency":
                    assert self._active() >= TENANT_IN_FLIGHT or (
                        route is not None and self._active(route) >= ROUTE_IN_FLIGHT
                    )
            return multiple()  # a refusal: nothing to settle
        event("admit: admitted")
        assert cost <= (ROUTE_BURST if route else TENANT_BURST)
        assert self._active() < TENANT_IN_FLIGHT
        assert route is None or self._active(route) < ROUTE_IN_FLIGHT
        self.model[r.reservation_id] = ModelReservation(
            r.reservation_id, route, cost, lease_seconds, lease_seconds
        )
        return r.reservation_id

    def _check_unchanged(self, before: dict[str, Any], after: dict[str, Any]) -> None:
        """A refusal debits nothing: `after` is `before` plus refill, to the microtoken."""
        for name, b in before.items():
            a = after[name]
            assert a["in_flight"] == b["in_flight"]
            seconds = (a["now"] - b["now"]).total_seconds()
            for kind, burst in (
                ("tokens", TENANT_BURST if name == "-" else ROUTE_BURST),
                ("requests", REQUEST_BURST),
            ):
                if b[kind] is None:
                    continue
                expected = min(float(burst), b[kind] + seconds * 1.0)
                assert abs(a[kind] - expected) < 1e-6, (name, kind, b[kind], a[kind])

    @rule(
        reservation_id=reservations,
        input_tokens=st.integers(0, 400),
        output_tokens=st.integers(0, 900),
    )
    def settle(self, reservation_id: uuid.UUID, input_tokens: int, output_tokens: int) -> None:
        r = self.model.get(reservation_id)
        if r is None:
            return
        charged = input_tokens + output_tokens
        try:
            s = self.run(
                self.limiter.settle(
                    reservation_id, input_tokens=input_tokens, output_tokens=output_tokens
                )
            )
        except ReservationConflict:
            # Released, or settled before with other figures.
            assert r.state == "released" or (r.charged is not None and r.charged != charged)
            event("settle: conflict")
            return
        if r.charged is not None:  # a replay of the same figures
            assert r.charged == charged and s.charged_tokens == charged
            return
        event(f"settle: {'late' if self._lapsed(r) or r.state == 'expired' else 'on time'}")
        if self._lapsed(r) or r.state == "expired":
            assert s.late and s.refunded_tokens == 0
            r.state, r.late = "expired", True
            self.debt_allowed += charged
        else:
            assert r.state == "active" and not s.late
            assert s.refunded_tokens == max(r.reserved - charged, 0)
            r.state = "settled"
            self.debt_allowed += max(charged - r.reserved, 0)
        assert s.charged_tokens == charged
        r.charged = charged

    @rule(reservation_id=reservations)
    def release(self, reservation_id: uuid.UUID) -> None:
        r = self.model.get(reservation_id)
        if r is None:
            return
        try:
            self.run(self.limiter.release(reservation_id))
        except ReservationConflict:
            assert r.state in ("settled", "expired") or self._lapsed(r)
            if self._lapsed(r):
                r.state = "expired"
            return
        assert r.state in ("active", "released") and not self._lapsed(r)
        r.state = "released"

    @rule(reservation_id=reservations)
    def heartbeat(self, reservation_id: uuid.UUID) -> None:
        r = self.model.get(reservation_id)
        if r is None:
            return
        try:
            self.run(self.limiter.heartbeat(reservation_id))
        except ReservationConflict:
            assert r.state != "active" or self._lapsed(r)
            return
        assert r.state == "active" and not self._lapsed(r)
        r.lease_left_seconds = r.lease_seconds

    @rule()
    def sweep(self) -> None:
        due = [r for r in self.model.values() if self._lapsed(r)]
        report = self.run(self.limiter.sweep())
        event(f"sweep: expired {min(len(due), 2)}+")
        assert report.expired == len(due)
        assert report.tokens_returned == sum(r.reserved for r in due)
        for r in due:
            r.state = "expired"

    @rule(steps=st.integers(1, 20))
    def advance_clock(self, steps: int) -> None:
        seconds = steps * STEP_SECONDS
        self.run(
            self.db.execute(
                "UPDATE limit_layers SET refilled_at = refilled_at - make_interval(secs => $1)",
                seconds,
            )
        )
        self.run(
            self.db.execute(
                """UPDATE reservations
                  SET lease_expires_at = lease_expires_at - make_interval(secs => $1)
                WHERE state = 'active'""",
                seconds,
            )
        )
        for r in self.model.values():
            if r.state == "active":
                r.lease_left_seconds -= seconds

    # -- invariants -----------------------------------------------------------

    @invariant()
    def books_balance(self) -> None:
        if not hasattr(self, "db"):
            return
        AdmissionMachine.tally["steps checked"] += 1
        layers = self.run(
            self.db.fetch(
                "SELECT coalesce(route, '-') AS layer, tokens, token_burst, in_flight "
                "FROM limit_layers WHERE tenant = 'acme'"
            )
        )
        for layer in layers:
            if layer["tokens"] is not None:
                assert -self.debt_allowed - 1e-6 <= layer["tokens"] <= layer["token_burst"]
            active = self._active(None if layer["layer"] == "-" else layer["layer"])
            assert layer["in_flight"] == active, (layer["layer"], layer["in_flight"], active)
        rows = self.run(
            self.db.fetch(
                "SELECT reservation_id, state, reserved_tokens, charged_tokens, refunded_tokens, "
                "late FROM reservations"
            )
        )
        assert len(rows) == len(self.model)
        for row in rows:
            r = self.model[row["reservation_id"]]
            # A lapsed lease the model has not seen expire yet is still 'active' in SQL.
            assert row["state"] == r.state
            assert row["reserved_tokens"] == r.reserved
            assert row["charged_tokens"] == r.charged
            if row["state"] == "settled":
                # reserved = charged + refunded - the excess debited beyond it
                excess = max(row["charged_tokens"] - row["reserved_tokens"], 0)
                assert row["reserved_tokens"] == (
                    row["charged_tokens"] + row["refunded_tokens"] - excess
                )
            assert row["late"] == r.late
        assert self.run(audit_findings(self.dsn)) == []


@pytest.mark.slow
def test_admission_state_machine(server_dsn: str, template_database: str) -> None:
    AdmissionMachine.server_dsn = server_dsn
    AdmissionMachine.template = template_database
    run_state_machine_as_test(
        AdmissionMachine,
        settings=settings(
            max_examples=30,
            derandomize=True,  # the same sequences every run: CI never flakes on luck
            stateful_step_count=50,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
    tally = AdmissionMachine.tally
    print(f"FIGURE invariants: {dict(sorted(tally.items()))}")
    assert tally["admit: admitted"] > 0 and tally["steps checked"] > 100
    assert tally["admit: concurrency RateLimited"] > 0
    assert tally["settle: late"] > 0 and tally["sweep: expired 1+"] + tally["sweep: expired 2+"]
