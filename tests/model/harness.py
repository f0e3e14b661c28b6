"""The random walk: steps against the real PostgreSQL, checks after every one.

A World holds one database (a copy of the migrated template), the Limiter
every ordinary step goes through, an outage Limiter connected through the
TCP proxy of tests/faults/proxy.py (frozen or cut for the outage steps), the
admin service for policies, shards, quotas and top-ups, and the Books of
model.py. `World.run` draws one step kind among the enabled ones (seeded),
runs it, and `World.check` compares every figure with the model; the first
difference raises Broken naming the seed, the step number, its kind and the
invariant, with the numbers.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import shutil
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import asyncpg

from llmquota.admin.alerts import AlertService
from llmquota.admin.service import AdminService
from llmquota.admission.limiter import Limiter
from llmquota.domain.errors import (
    InvalidRequest,
    LimiterError,
    ReservationConflict,
)
from llmquota.domain.key_limits import KeyLimits
from llmquota.domain.plans import Ceiling
from llmquota.domain.policy import MAX_LEASE_SECONDS, Policy
from llmquota.domain.quotas import QuotaSpec
from llmquota.domain.validation import MAX_TOKEN_COUNT
from llmquota.finance.ledger import LedgerStore
from llmquota.store.store import Store
from tests.faults.conftest import Worker, fault_settings
from tests.faults.proxy import PgProxy
from tests.model.model import (
    CEILING,
    GLOBAL,
    KEY,
    PRICES,
    Books,
    Credit,
    Held,
    Layer,
    LayerKey,
    QuotaUse,
    cost,
)

# Every step kind, by the one name that switches it on or off.
ALL_KINDS = (
    "admit",
    "settle",
    "settle_absurd",
    "settle_malformed",
    "release",
    "expire",
    "policy_change",
    "topup",
    "reshard",
    "refill",
    "outage",
    "outage_kill",
    "late_statement",
    "export",
)
# Relative frequencies (admissions and settlements dominate, as in traffic).
WEIGHTS = {
    "admit": 380,
    "settle": 200,
    "settle_absurd": 12,
    "settle_malformed": 20,
    "release": 80,
    "expire": 50,
    "policy_change": 30,
    "topup": 30,
    "reshard": 20,
    "refill": 12,
    "outage": 12,
    "outage_kill": 2,
    "late_statement": 8,
    "export": 15,
}
TENANTS = ("t0", "t1", "t2", "t3")
FIRST_MODES = {"t0": "open", "t1": "local", "t2": "open", "t3": "closed"}
MODELS = ("gpt-4o", "gpt-4o-mini")
# 1 token a minute everywhere: refill between two checks is a fraction of a token.
RATE_PER_MINUTE = 1
# lq_put_global needs every rate at least the shard count: 1 a minute per shard of 4.
GLOBAL_RATE_PER_MINUTE = 4
TENANT_BURSTS = (15_000, 20_000, 30_000)
GLOBAL_BURSTS = (150_000, 200_000, 300_000)
CEILING_BURSTS = (50_000, 80_000)
IN_FLIGHT = (6, 10, 16)
DAILY_QUOTA_TOKENS = 1_000_000_000
SMALL_QUOTA_TOKENS = (50_000, 150_000)  # t2's, to meet its edge now and then
# t0's limited key: a burst below its tenant's, so that it binds now and then,
# and fewer permits; half of t0's requests are made with it.
KEY_BURST, KEY_IN_FLIGHT, KEYED_SHARE = 9_000, 4, 0.5
# Tenants whose calls take no in-flight permit at first (uses_concurrency false).
NO_PERMIT_TENANTS = ("t2",)
FIRST_CREDIT = Decimal("5.00")
# t3 lives near an empty balance, so admission meets 402 as often as top-ups refill it.
LEAN_TENANT, LEAN_CREDIT = "t3", Decimal("0.05")
FLOAT_SLACK = 1e-3  # double precision over balances of at most ~1e8 tokens
ADMIT_SLACK_TOKENS = 1.0
OUTAGE_DEADLINE_MS = 250
REPLAY_WAIT_SECONDS = 20.0
PROGRESS_EVERY = 5_000  # a line on stdout for the long runs
# Page sizes and numbering limits a billing consumer reads the export with.
EXPORT_PAGES = (1, 3, 50)
# How long a row may be held back (a transaction still running): never skipped.
EXPORT_CATCH_UP_SECONDS = 5.0
MALFORMED: tuple[Any, ...] = (-1, 1.5, "42", True, None, MAX_TOKEN_COUNT + 1, float("nan"))


class Broken(AssertionError):
    """An invariant failed: the message says the seed, step, kind and the numbers."""


@dataclass
class Outcome:
    """What one run did, for the report."""

    seed: int
    steps: int
    tally: Counter[str]
    seconds: float


class World:
    """One database, its limiters and the model, driven by one seeded generator."""

    def __init__(self, dsn: str, seed: int, kinds: frozenset[str]) -> None:
        unknown = kinds - set(ALL_KINDS)
        if unknown:
            raise ValueError(f"unknown step kinds {sorted(unknown)}")
        self.dsn = dsn
        self.seed = seed
        self.kinds = sorted(kinds)
        self.rng = random.Random(seed)
        self.books = Books()
        self.tally: Counter[str] = Counter()
        self.step_no = 0
        self.kind = "setup"
        self.touched: set[uuid.UUID] = set()
        self.references: list[tuple[str, str, Decimal]] = []
        self.shards = 1
        self.global_burst = GLOBAL_BURSTS[0]
        # The permits a call of each tenant takes now (its uses_concurrency).
        self.permits = {tenant: 0 if tenant in NO_PERMIT_TENANTS else 1 for tenant in TENANTS}
        self.last_now: Any = None
        self.spool = Path(tempfile.mkdtemp(prefix="llmquota-model-spool-"))
        # What the billing export gave so far (entry id: its tokens), and its cursor.
        self.exported: dict[int, tuple[int, int]] = {}
        self.export_cursor = 0

    # -- setup and teardown -------------------------------------------------------
    async def open(self) -> None:
        self.db: asyncpg.Connection = await asyncpg.connect(self.dsn)
        self.proxy = await PgProxy(self.dsn).start()
        self.limiter = await Limiter.connect(
            self.dsn, fault_settings(decision_deadline_ms=10_000, pool_max_size=4)
        )
        self.outage = await Limiter.connect(
            self.proxy.dsn,
            fault_settings(
                decision_deadline_ms=OUTAGE_DEADLINE_MS, pool_max_size=2, outage_probe_seconds=0.05
            ),
        )
        self.admin_store = await Store.connect(self.dsn, min_size=1, max_size=2)
        self.admin = AdminService(self.admin_store, deadline_seconds=30.0)
        self.alerts = AlertService(self.admin_store, deadline_seconds=30.0)
        for model, (price_in, price_out) in PRICES.items():
            await self.db.execute(
                """INSERT INTO model_prices (model, effective_from, input_usd_per_million,
                                             output_usd_per_million)
                   VALUES ($1, '2020-01-01', $2, $3)""",
                model,
                price_in,
                price_out,
            )
        await self._put_global(self.global_burst, None)
        self.books.layers[GLOBAL] = Layer(self.global_burst, float(self.global_burst))
        await self._put_ceiling(CEILING_BURSTS[0])
        self.books.layers[CEILING] = Layer(CEILING_BURSTS[0], float(CEILING_BURSTS[0]))
        for tenant in TENANTS:
            policy = {
                "token_burst": TENANT_BURSTS[1],
                "max_in_flight": IN_FLIGHT[1],
                "failure_mode": FIRST_MODES[tenant],
            }
            if tenant in NO_PERMIT_TENANTS:
                policy["uses_concurrency"] = False
            await self._put_tenant(tenant, policy)
            self.books.layers[("tenant", tenant)] = Layer(TENANT_BURSTS[1], float(TENANT_BURSTS[1]))
            quota = SMALL_QUOTA_TOKENS[0] if tenant == "t2" else DAILY_QUOTA_TOKENS
            await self._put_quota(tenant, quota)
            self.books.quotas[tenant] = QuotaUse()
            self.books.credits[tenant] = Credit()
            await self._top_up(tenant, LEAN_CREDIT if tenant == LEAN_TENANT else FIRST_CREDIT)
        limits = KeyLimits(
            tokens_per_minute=RATE_PER_MINUTE, token_burst=KEY_BURST, max_in_flight=KEY_IN_FLIGHT
        )
        self.key_id = (await self.admin.keys.create(KEY[1], limits=limits)).record.key_id
        self.books.layers[KEY] = Layer(KEY_BURST, float(KEY_BURST))
        await self.outage.refresh_policies()
        await self.check()

    async def close(self) -> None:
        for closing in (self.limiter.close(), self.outage.close(), self.admin_store.close()):
            with contextlib.suppress(Exception):
                await closing
        await self.proxy.close()
        await self.db.close()
        shutil.rmtree(self.spool, ignore_errors=True)

    # -- administration (the admin service, as an operator would) ------------------
    async def _put_global(self, burst: int, shards: int | None) -> None:
        policy = Policy(
            tokens_per_minute=GLOBAL_RATE_PER_MINUTE, token_burst=burst, failure_mode="open"
        )
        await self.admin.put_policy("global", None, None, policy, shards=shards)

    async def _put_ceiling(self, burst: int) -> None:
        ceiling = Ceiling(
            models=list(PRICES)[:1], tokens_per_minute=RATE_PER_MINUTE, token_burst=burst, shed=[]
        )
        await self.admin.put_ceiling(CEILING[1], ceiling)

    async def _put_tenant(self, tenant: str, policy: dict[str, Any]) -> None:
        own = {
            "tokens_per_minute": RATE_PER_MINUTE,
            "lease_seconds": MAX_LEASE_SECONDS,
            "prepaid": True,
            **policy,
        }
        await self.admin.put_tenant_policy(tenant, None, own)

    async def _put_quota(self, tenant: str, tokens: int) -> None:
        await self.alerts.put_quota(tenant, None, "daily", QuotaSpec(period="day", tokens=tokens))

    async def _top_up(self, tenant: str, amount: Decimal, reference: str | None = None) -> bool:
        reference = reference or f"ref-{uuid.uuid4().hex[:12]}"
        applied = (await self.alerts.alerts.credit_topup(tenant, amount, reference)).applied
        if applied:
            self.books.top_up(tenant, amount)
            self.references.append((tenant, reference, amount))
        return applied

    # -- the walk -------------------------------------------------------------------
    async def run(self, steps: int) -> Outcome:
        started = time.perf_counter()
        weights = [WEIGHTS[k] for k in self.kinds]
        for self.step_no in range(1, steps + 1):
            self.kind = self.rng.choices(self.kinds, weights)[0]
            self.touched = set()
            await getattr(self, f"step_{self.kind}")()
            self.tally[f"step {self.kind}"] += 1
            await self.check()
            if self.step_no % PROGRESS_EVERY == 0:
                seconds = time.perf_counter() - started
                print(
                    f"model: seed {self.seed}, {self.step_no} steps checked in {seconds:.0f} s",
                    flush=True,
                )
        return Outcome(self.seed, steps, self.tally, time.perf_counter() - started)

    def fail(self, invariant: str, detail: str) -> Broken:
        return Broken(
            f"seed {self.seed}, step {self.step_no} ({self.kind}): {invariant}: {detail} "
            f"[kinds {','.join(self.kinds)}; replay with LLMQUOTA_MODEL_SEED={self.seed}]"
        )

    def _pick(self, states: tuple[str, ...] = ("active",)) -> Held | None:
        candidates = [
            h
            for h in self.books.held.values()
            if h.state in states or ("unsettled" in states and h.usage is None)
        ]
        return self.rng.choice(candidates) if candidates else None

    def _request(self) -> dict[str, Any]:
        tenant = self.rng.choice(TENANTS)
        model = self.rng.choice(MODELS)
        max_tokens = self.rng.randint(1, 1_500)
        if self.rng.random() < 0.03:
            max_tokens = 16_000  # larger than a tenant's burst now and then
        keyed = tenant == KEY[1] and self.rng.random() < KEYED_SHARE
        return {
            "tenant": tenant,
            "model": model,
            "input_tokens": self.rng.randint(0, 300),
            "max_tokens": max_tokens,
            "lease_seconds": MAX_LEASE_SECONDS,
            "key_id": self.key_id if keyed else None,
        }

    def _held(self, reservation_id: uuid.UUID, request: dict[str, Any], outage: bool) -> Held:
        tenant, model = request["tenant"], request["model"]
        return Held(
            reservation_id=reservation_id,
            tenant=tenant,
            model=model,
            input_tokens=request["input_tokens"],
            max_tokens=request["max_tokens"],
            layers=self.books.layers_for(tenant, model, keyed=request["key_id"] is not None),
            credit_hold=cost(model, request["input_tokens"], request["max_tokens"]),
            outage=outage,
            permits=self.permits[tenant],
        )

    def _usage(self, held: Held, absurd: bool) -> tuple[int, int]:
        if absurd:
            total = int(10 ** self.rng.uniform(4, math.log10(MAX_TOKEN_COUNT)))
            input_tokens = self.rng.randint(0, total // 10)
            return input_tokens, total - input_tokens
        output_limit = held.max_tokens if self.rng.random() < 0.9 else held.max_tokens * 2
        return (
            self.rng.randint(0, held.input_tokens + 10),
            self.rng.randint(0, output_limit),
        )

    # -- steps ------------------------------------------------------------------------
    async def step_admit(self) -> None:
        request = self._request()
        try:
            r = await self.limiter.admit(**request)
        except LimiterError as refusal:
            limit = getattr(refusal, "limit", "") or ""
            scope = getattr(refusal, "scope", "") or ""
            self.tally[f"admit refused {type(refusal).__name__} {limit} {scope}".rstrip()] += 1
            return
        held = self._held(r.reservation_id, request, outage=False)
        if not self.books.fits(held.layers, held.reserved, self._tolerance()):
            raise self.fail(
                "admitted beyond a layer's balance",
                f"{held.reserved} tokens, balances "
                f"{[self.books.layers[k].balance for k in held.layers]}",
            )
        self.books.admit(held)
        self.touched.add(held.reservation_id)
        self.tally["admit admitted"] += 1

    async def _settle(self, held: Held, input_tokens: Any, output_tokens: Any) -> str:
        self.touched.add(held.reservation_id)
        try:
            s = await self.limiter.settle(
                held.reservation_id, input_tokens=input_tokens, output_tokens=output_tokens
            )
        except ReservationConflict as conflict:
            expected = self.books.settle(held, input_tokens, output_tokens)
            if expected != "conflict":
                raise self.fail(
                    "settle answered conflict", f"the model expected {expected}"
                ) from conflict
            return "conflict"
        expected = self.books.settle(held, input_tokens, output_tokens)
        if expected == "conflict" or s.late != (expected == "late" or held.late):
            raise self.fail("settle answer", f"late={s.late}, the model expected {expected}")
        if s.charged_tokens != input_tokens + output_tokens:
            charged = input_tokens + output_tokens
            raise self.fail("charged tokens", f"{s.charged_tokens} != {charged}")
        return expected

    async def step_settle(self) -> None:
        held = self._pick() if self.rng.random() < 0.7 else None
        held = held or self._pick(("active", "unsettled", "settled"))
        if held is None:
            return
        if held.usage is not None and self.rng.random() < 0.5:
            usage = held.usage  # a replay of the same figures
        else:
            usage = self._usage(held, absurd=False)
        self.tally[f"settle {await self._settle(held, *usage)}"] += 1

    async def step_settle_absurd(self) -> None:
        held = self._pick(("active", "unsettled"))
        if held is None:
            return
        answer = await self._settle(held, *self._usage(held, absurd=True))
        self.tally[f"settle absurd {answer}"] += 1

    async def step_settle_malformed(self) -> None:
        held = self._pick(("active", "unsettled"))
        if held is None:
            return
        bad = self.rng.choice(MALFORMED)
        figures = [self.rng.randint(0, 100), bad]
        self.rng.shuffle(figures)
        try:
            await self.limiter.settle(
                held.reservation_id, input_tokens=figures[0], output_tokens=figures[1]
            )
        except InvalidRequest:
            self.tally["settle malformed refused"] += 1
            self.touched.add(held.reservation_id)
            return
        raise self.fail("malformed usage accepted", f"settle({figures[0]!r}, {figures[1]!r})")

    async def step_release(self) -> None:
        held = self._pick(("active", "settled", "released"))
        if held is None:
            return
        self.touched.add(held.reservation_id)
        try:
            await self.limiter.release(held.reservation_id)
        except ReservationConflict as conflict:
            if held.state in ("active", "released"):
                raise self.fail(
                    "release answered conflict", f"the model has it {held.state}"
                ) from conflict
            self.tally["release conflict"] += 1
            return
        if held.state == "active":
            self.books.give_back(held, expired=False)
            self.tally["release released"] += 1
        elif held.state != "released":
            raise self.fail("release accepted", f"the model has it {held.state}")

    async def step_expire(self) -> None:
        held = self._pick()
        if held is None:
            return
        self.touched.add(held.reservation_id)
        # The lease forced past (as the owner), then the sweeper's own statement.
        await self.db.execute(
            """UPDATE reservations SET lease_expires_at = clock_timestamp() - interval '1 second'
                WHERE reservation_id = $1 AND state = 'active'""",
            held.reservation_id,
        )
        report = await self.limiter.sweep()
        if report.expired != 1 or report.tokens_returned != held.reserved:
            raise self.fail(
                "sweep",
                f"expired {report.expired} returning {report.tokens_returned}, "
                f"the model expected 1 returning {held.reserved}",
            )
        self.books.give_back(held, expired=True)
        self.tally["expire expired"] += 1

    async def step_policy_change(self) -> None:
        what = self.rng.choice(("tenant", "tenant", "global", "ceiling", "quota"))
        if what == "tenant":
            tenant = self.rng.choice(TENANTS)
            burst = self.rng.choice(TENANT_BURSTS)
            policy: dict[str, Any] = {
                "token_burst": burst,
                "max_in_flight": self.rng.choice(IN_FLIGHT),
                "failure_mode": self.rng.choice(("open", "local", "closed")),
            }
            # what its calls take may change under reservations that hold permits
            permits = 1 if self.rng.random() < 0.7 else 0
            if not permits:
                policy["uses_concurrency"] = False
            await self._put_tenant(tenant, policy)
            self.permits[tenant] = permits
            self.books.set_burst(("tenant", tenant), burst)
        elif what == "global":
            self.global_burst = self.rng.choice(GLOBAL_BURSTS)
            await self._put_global(self.global_burst, None)
            self.books.set_burst(GLOBAL, self.global_burst)
        elif what == "ceiling":
            burst = self.rng.choice(CEILING_BURSTS)
            await self._put_ceiling(burst)
            self.books.set_burst(CEILING, burst)
        else:
            await self._put_quota("t2", self.rng.choice(SMALL_QUOTA_TOKENS))
        self.tally[f"policy change {what}"] += 1

    async def step_topup(self) -> None:
        if self.references and self.rng.random() < 0.2:
            tenant, reference, amount = self.rng.choice(self.references)
            if await self._top_up(tenant, amount, reference):
                raise self.fail("top-up", f"reference {reference} applied twice")
            self.tally["topup repeated"] += 1
            return
        tenant = self.rng.choice(TENANTS)
        cents = self.rng.randint(1, 5) if tenant == LEAN_TENANT else self.rng.randint(50, 2_000)
        await self._top_up(tenant, Decimal(cents) / 100)
        self.tally["topup applied"] += 1

    async def step_reshard(self) -> None:
        self.shards = self.rng.choice([k for k in (1, 2, 3, 4) if k != self.shards])
        await self._put_global(self.global_burst, self.shards)
        self.tally[f"reshard to {self.shards}"] += 1

    async def step_refill(self) -> None:
        # Five thousand years pass for the buckets (only for them): 2.6e9 tokens of
        # refill at 1 a minute, more than any debt the walk can run up, so every
        # layer is full. Set, not subtracted, so repeated refills stay in range.
        await self.db.execute(
            "UPDATE limit_layers SET refilled_at = clock_timestamp() - interval '5000 years'"
        )
        self.books.refill_all()
        self.tally["refill"] += 1

    # -- outages --------------------------------------------------------------------
    async def step_outage(self) -> None:
        await self.outage.refresh_policies()
        hang = self.rng.random() < 0.3
        if hang:
            self.proxy.pause()  # packets dropped: each decision waits out the deadline
        else:
            await self.proxy.cut()  # connections refused: decided at once
        admitted: list[tuple[Held, tuple[str, tuple[int, int]] | None]] = []
        try:
            for _ in range(self.rng.randint(1, 4)):
                request = self._request()
                try:
                    r = await self.outage.admit(**request)
                except LimiterError as refusal:
                    self.tally[f"outage refused {type(refusal).__name__}"] += 1
                    continue
                held = self._held(r.reservation_id, request, outage=True)
                finish: tuple[str, tuple[int, int]] | None = None
                roll = self.rng.random()
                if roll < 0.6:
                    usage = self._usage(held, absurd=False)
                    await self.outage.settle(
                        held.reservation_id, input_tokens=usage[0], output_tokens=usage[1]
                    )
                    finish = ("settle", usage)
                elif roll < 0.8:
                    await self.outage.release(held.reservation_id)
                    finish = ("release", (0, 0))
                admitted.append((held, finish))
                self.tally["outage admitted"] += 1
        finally:
            if hang:
                self.proxy.resume()
            else:
                await self.proxy.restore()
        await self._wait_replayed(lambda: len(self.outage.journal) == 0)
        self._record(admitted)
        self.tally[f"outage {'hang' if hang else 'refused'}"] += 1

    async def step_outage_kill(self) -> None:
        """A worker subprocess admits during an outage and is killed (-9) as the store
        comes back, before, during or after its replay; another worker adopts its spool."""
        worker = await Worker.start(
            self.proxy.dsn,
            LLMQUOTA_OUTAGE_SPOOL_DIR=str(self.spool),
            LLMQUOTA_DECISION_DEADLINE_MS="2000",
            LLMQUOTA_OUTAGE_PROBE_SECONDS="0.02",
        )
        admitted: list[tuple[Held, tuple[str, tuple[int, int]] | None]] = []
        ids: list[uuid.UUID] = []
        restored = False
        try:
            await self.proxy.cut()
            for _ in range(self.rng.randint(2, 6)):
                request = self._request()
                answer = await worker.call(op="admit", **request)
                if not answer["admitted"]:
                    self.tally[f"outage kill refused {answer['refused'][0]['error']}"] += 1
                    continue
                held = self._held(uuid.UUID(answer["admitted"][0]["reservation_id"]), request, True)
                finish: tuple[str, tuple[int, int]] | None = None
                if self.rng.random() < 0.6:
                    usage = self._usage(held, absurd=False)
                    settled = await worker.call(
                        op="settle",
                        reservation_id=str(held.reservation_id),
                        input_tokens=usage[0],
                        output_tokens=usage[1],
                    )
                    if "error" in settled:
                        raise self.fail("outage settle in the worker", str(settled))
                    finish = ("settle", usage)
                admitted.append((held, finish))
            await self.proxy.restore()
            restored = True
            ids = [h.reservation_id for h, _ in admitted]
            if ids and self.rng.random() < 0.5:
                await self._until_recorded(ids)  # the replay has begun: kill it now
            else:
                await asyncio.sleep(self.rng.uniform(0.0, 0.12))
            worker.process.kill()
            await worker.process.wait()
        finally:
            await worker.stop()
            if not restored:
                await self.proxy.restore()
        finished = [h.reservation_id for h, f in admitted if f is not None]
        recorded, billed = await self.db.fetchrow(
            """SELECT (SELECT count(*) FROM reservations WHERE reservation_id = ANY ($1)),
                      (SELECT count(*) FROM usage_ledger WHERE reservation_id = ANY ($2))""",
            ids,
            finished,
        )
        done = recorded == len(ids) and billed == len(finished)
        when = "before" if recorded == 0 else "after" if done else "mid"
        self.tally[f"outage kill {when} replay"] += 1
        adopter = await Limiter.connect(self.dsn, fault_settings(outage_spool_dir=str(self.spool)))
        try:
            await self._wait_replayed(lambda: len(adopter.journal) == 0)
        finally:
            await adopter.close()
        if list(self.spool.glob("spool-*.jsonl")):
            raise self.fail("spool", "a spool file is left after adoption")
        self._record(admitted)

    async def step_late_statement(self) -> None:
        """An admit statement that waits on a row lock past the decision deadline, and
        runs once the lock is gone: the caller has the failure mode's answer by then,
        so whatever the late statement writes must not stay as a second hold."""
        request = self._request()
        await self.outage.refresh_policies()
        locked = self.db.transaction()
        await locked.start()
        try:
            await self.db.execute(
                """SELECT 1 FROM limit_layers WHERE scope = 'tenant' AND tenant = $1
                   FOR UPDATE""",
                request["tenant"],
            )
            try:
                r = await self.outage.admit(**request)
            except LimiterError as refusal:
                r = None
                self.tally[f"late statement refused {type(refusal).__name__}"] += 1
        finally:
            await locked.commit()  # within the server's 1 s check for a client gone
        await self._until_admit_statements_done()
        await self._wait_replayed(lambda: len(self.outage.journal) == 0)
        # The late statement may have committed (its deadline allows the wait's
        # event-loop stalls): the abandoned-ids journal releases what it made.
        await self.outage.flush_outage_journal()
        if r is not None:
            held = self._held(r.reservation_id, request, outage=True)
            self._record([(held, None)])
            self.tally["late statement admitted by the failure mode"] += 1

    async def step_export(self) -> None:
        """Finance's billing export, read from its cursor as a consumer pages it:
        ids 1, 2, 3, ... without a gap, each ledger row once and as the ledger
        holds it, and every row exported within EXPORT_CATCH_UP_SECONDS (a
        transaction still running holds rows back; none is ever skipped)."""
        store = LedgerStore(self.db)
        pages, numbering = self.rng.choice(EXPORT_PAGES), self.rng.choice(EXPORT_PAGES)
        deadline = time.monotonic() + EXPORT_CATCH_UP_SECONDS
        while True:
            async for entry in store.export(
                self.export_cursor, limit=None, page_rows=pages, number_limit=numbering
            ):
                if entry.export_id != self.export_cursor + 1:
                    raise self.fail("export ids", f"{entry.export_id} after {self.export_cursor}")
                if entry.entry_id in self.exported:
                    raise self.fail("export", f"entry {entry.entry_id} exported twice")
                self.exported[entry.entry_id] = (entry.input_tokens, entry.output_tokens)
                self.export_cursor = entry.export_id
            ledger = {
                row["entry_id"]: (row["input_tokens"], row["output_tokens"])
                for row in await self.db.fetch(
                    "SELECT entry_id, input_tokens, output_tokens FROM usage_ledger"
                )
            }
            wrong = {e: t for e, t in self.exported.items() if ledger.get(e) != t}
            if wrong:
                raise self.fail("exported rows as the ledger holds them", f"{wrong}")
            missing = sorted(ledger.keys() - self.exported.keys())
            if not missing:
                self.tally["export caught up"] += 1
                return
            if time.monotonic() > deadline:
                raise self.fail(
                    "every ledger row exported",
                    f"{len(missing)} rows not exported in {EXPORT_CATCH_UP_SECONDS} s: "
                    f"{missing[:5]}",
                )
            await asyncio.sleep(0.05)

    async def _until_admit_statements_done(self) -> None:
        """Wait (at most REPLAY_WAIT_SECONDS) until no backend runs an admission."""
        deadline = time.monotonic() + REPLAY_WAIT_SECONDS
        while await self.db.fetchval(
            """SELECT count(*) FROM pg_stat_activity
                WHERE pid <> pg_backend_pid() AND state = 'active'
                  AND query LIKE '%lq_admit(%'"""
        ):
            if time.monotonic() > deadline:
                raise self.fail("late statement", "still running after the lock was gone")
            await asyncio.sleep(0.01)

    async def _until_recorded(self, ids: list[uuid.UUID]) -> None:
        """Wait (at most REPLAY_WAIT_SECONDS) for the first of `ids` to reach the store."""
        deadline = time.monotonic() + REPLAY_WAIT_SECONDS
        while not await self.db.fetchval(
            "SELECT count(*) FROM reservations WHERE reservation_id = ANY ($1)", ids
        ):
            if time.monotonic() > deadline:
                raise self.fail("replay", f"nothing recorded within {REPLAY_WAIT_SECONDS} s")
            await asyncio.sleep(0.002)

    async def _wait_replayed(self, done: Callable[[], bool]) -> None:
        deadline = time.monotonic() + REPLAY_WAIT_SECONDS
        while not done():
            if time.monotonic() > deadline:
                raise self.fail("replay", f"journal not recorded within {REPLAY_WAIT_SECONDS} s")
            await asyncio.sleep(0.02)

    def _record(self, admitted: list[tuple[Held, tuple[str, tuple[int, int]] | None]]) -> None:
        """The model of a replay: every admission recorded first, then the finishes."""
        for held, _ in admitted:
            self.books.record_outage(held)
            self.touched.add(held.reservation_id)
        for held, finish in admitted:
            if finish is None:
                continue
            action, usage = finish
            if action == "settle":
                self.books.settle(held, *usage)
            else:
                self.books.give_back(held, expired=False)

    # -- the invariants ----------------------------------------------------------------
    def _tolerance(self) -> float:
        """How far above the model's balance the database may be when it admits: the
        refill since the last check, far below one token at these rates."""
        return ADMIT_SLACK_TOKENS

    async def check(self) -> None:
        """Every figure against the model, after every step."""
        actual, seconds, now = await self._load_layers()
        # The holds first: a reservation nobody holds explains a layer's shortfall.
        await self._check_reservations()
        self._compare_layers(actual, seconds)
        self.last_now = now
        await self._check_ledger()
        await self._check_credits()
        await self._check_quotas()
        findings = await self.admin_store.audit()
        if findings:
            lines = [f"{f.check_name} {f.subject}: {f.expected} != {f.actual}" for f in findings]
            raise self.fail("lq_audit()", "; ".join(lines[:5]))

    async def _load_layers(self) -> tuple[dict[LayerKey, list[Any]], float, Any]:
        """Every layer refilled to now, summed by key (a sharded global layer as one):
        (tokens, burst, in flight, rate) by key, the seconds since the last check, now."""
        rows = await self.db.fetch(
            """SELECT l.layer_id, l.scope, l.tenant, l.ceiling, l.token_burst,
                      l.tokens_per_minute, l.in_flight, t.now,
                      lq_refilled(l.tokens, l.tokens_per_minute, l.token_burst, l.refilled_at,
                                  t.now) AS tokens
                 FROM limit_layers AS l, (SELECT clock_timestamp() AS now) AS t"""
        )
        now = rows[0]["now"]
        seconds = 0.0 if self.last_now is None else (now - self.last_now).total_seconds()
        actual: dict[LayerKey, list[Any]] = {}
        self.layer_keys: dict[int, LayerKey] = {}
        for row in rows:
            key: LayerKey = (
                GLOBAL
                if row["scope"] == "global"
                else (
                    row["scope"],
                    row["tenant"] if row["scope"] in ("tenant", "key") else row["ceiling"],
                )
            )
            self.layer_keys[row["layer_id"]] = key
            figures = actual.setdefault(key, [0.0, 0, 0, 0])
            figures[0] += row["tokens"]
            figures[1] += row["token_burst"]
            figures[2] += row["in_flight"]
            figures[3] += row["tokens_per_minute"]
        return actual, seconds, now

    def _compare_layers(self, actual: dict[LayerKey, list[Any]], seconds: float) -> None:
        """Conservation per layer: the database within [model, model + the refill the
        elapsed time allows]; then the model is anchored to the database."""
        for key, layer in self.books.layers.items():
            tokens, burst, in_flight, per_minute = actual[key]
            refill = per_minute * seconds / 60.0
            if not (-FLOAT_SLACK <= tokens - layer.balance <= refill + FLOAT_SLACK):
                raise self.fail(
                    f"tokens of {key[0]} {key[1]}".rstrip(),
                    f"database {tokens:.3f}, model {layer.balance:.3f} "
                    f"(refill allowed {refill:.4f}; burst {burst})",
                )
            if burst != layer.burst or in_flight != layer.in_flight:
                raise self.fail(
                    f"burst / in flight of {key[0]} {key[1]}".rstrip(),
                    f"database {burst} / {in_flight}, model {layer.burst} / {layer.in_flight}",
                )
            layer.balance = tokens  # anchored: the next step is checked from here

    async def _check_reservations(self) -> None:
        rows = await self.db.fetch(
            """SELECT reservation_id, tenant, layer_ids, reserved_tokens, credit_reserved,
                      cardinality(quota_ids) AS quotas, permits
                 FROM reservations WHERE state = 'active'"""
        )
        active = {h.reservation_id: h for h in self.books.active()}
        found = {row["reservation_id"] for row in rows}
        if found != set(active):
            extra, missing = found - set(active), set(active) - found
            raise self.fail(
                "active reservations",
                f"{len(extra)} in the database the model does not hold (e.g. "
                f"{sorted(map(str, extra))[:2]}), {len(missing)} missing "
                f"(e.g. {sorted(map(str, missing))[:2]})",
            )
        for row in rows:
            held = active[row["reservation_id"]]
            keys = sorted(self.layer_keys.get(i, ("deleted", str(i))) for i in row["layer_ids"])
            expected = (held.reserved, held.credit_hold, sorted(held.layers), 1, held.permits)
            got = (
                row["reserved_tokens"],
                row["credit_reserved"],
                keys,
                row["quotas"] or 0,
                row["permits"],
            )
            if got != expected:
                raise self.fail(
                    f"holds of {held.reservation_id} ({'outage' if held.outage else 'store'})",
                    f"(reserved, credit held, layers, quotas, permits) database {got}, "
                    f"model {expected}",
                )

    async def _check_ledger(self) -> None:
        totals = await self.db.fetchrow(
            """SELECT count(*) AS n, coalesce(sum(input_tokens), 0) AS i,
                      coalesce(sum(output_tokens), 0) AS o FROM usage_ledger"""
        )
        b = self.books
        if (totals["n"], totals["i"], totals["o"]) != (
            b.ledger_rows,
            b.ledger_input,
            b.ledger_output,
        ):
            raise self.fail(
                "ledger totals (rows, input, output)",
                f"database {tuple(totals)}, model "
                f"{(b.ledger_rows, b.ledger_input, b.ledger_output)}",
            )
        if not self.touched:
            return
        rows = await self.db.fetch(
            """SELECT reservation_id, entry_kind, input_tokens, output_tokens, outcome
                 FROM usage_ledger WHERE reservation_id = ANY ($1)""",
            list(self.touched),
        )
        per: dict[uuid.UUID, list[tuple[str, int, int, str]]] = {}
        for row in rows:
            per.setdefault(row["reservation_id"], []).append(
                (row["entry_kind"], row["input_tokens"], row["output_tokens"], row["outcome"])
            )
        for reservation_id in self.touched:
            held = b.held.get(reservation_id)
            expected = sorted(held.ledger) if held else []
            if sorted(per.get(reservation_id, [])) != expected:
                raise self.fail(
                    f"ledger rows of {reservation_id}",
                    f"database {sorted(per.get(reservation_id, []))}, model {expected}",
                )

    async def _check_credits(self) -> None:
        rows = await self.db.fetch(
            """SELECT a.tenant, a.balance, a.reserved,
                      (SELECT coalesce(sum(c.amount), 0) FROM credit_ledger AS c
                        WHERE c.tenant = a.tenant) AS ledger
                 FROM credit_accounts AS a"""
        )
        for row in rows:
            model = self.books.credits[row["tenant"]]
            if row["balance"] != row["ledger"]:
                raise self.fail(
                    f"credit balance of {row['tenant']} = its ledger",
                    f"balance {row['balance']}, ledger sum {row['ledger']}",
                )
            if (row["balance"], row["reserved"]) != (model.balance, model.reserved):
                raise self.fail(
                    f"credits of {row['tenant']} (balance, reserved)",
                    f"database ({row['balance']}, {row['reserved']}), "
                    f"model ({model.balance}, {model.reserved})",
                )

    async def _check_quotas(self) -> None:
        rows = await self.db.fetch(
            """SELECT w.tenant, w.window_id, w.reserved_tokens, w.charged_tokens,
                      (SELECT coalesce(sum(u.input_tokens + u.output_tokens), 0)
                         FROM usage_ledger AS u
                        WHERE u.tenant = w.tenant AND u.recorded_at >= w.window_start
                          AND u.recorded_at < w.window_end) AS ledger
                 FROM quota_windows AS w"""
        )
        sums: dict[str, list[int]] = {t: [0, 0] for t in TENANTS}
        for row in rows:
            if row["charged_tokens"] != row["ledger"]:
                raise self.fail(
                    f"quota window {row['window_id']} of {row['tenant']} = its charges",
                    f"charged {row['charged_tokens']}, ledger {row['ledger']}",
                )
            sums[row["tenant"]][0] += row["reserved_tokens"]
            sums[row["tenant"]][1] += row["charged_tokens"]
        for tenant, (reserved, charged) in sums.items():
            model = self.books.quotas[tenant]
            if (reserved, charged) != (model.reserved, model.charged):
                raise self.fail(
                    f"quota of {tenant} (reserved, charged)",
                    f"database ({reserved}, {charged}), model ({model.reserved}, {model.charged})",
                )


async def walk(dsn: str, seed: int, steps: int, kinds: frozenset[str]) -> Outcome:
    """One seeded run of `steps` steps over the enabled kinds; raises Broken."""
    world = World(dsn, seed, kinds)
    await world.open()
    try:
        outcome = await world.run(steps)
        if "export" in world.kinds:
            world.kind = "final export"
            await world.step_export()  # however the walk ended, billing has every row
        return outcome
    except Broken:
        print(f"model: what the walk did until it broke: {dict(sorted(world.tally.items()))}")
        raise
    finally:
        await world.close()
