"""Where a service over cells sends each request, and how a shared limit's
write is split and its reads added up (api/cells_routing.py, domain/cells.py)."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest

from llmquota.admin.ceiling_alerts import CeilingAlertDetector
from llmquota.admin.ceilings_over_cells import IN_TRANSIT_SECONDS, CeilingsOverCells
from llmquota.api.auth import KeyLookup, TooManyFailedAuthentications
from llmquota.api.cells_listing import merged_page, places_of
from llmquota.api.cells_routing import KeyCells, Route, StoredAdminKey, authorization_of, route_of
from llmquota.api.routes.tenant_directory import encode_cursor
from llmquota.config import Settings
from llmquota.domain.ceiling_alerts import AlertDefaults, ceiling_samples
from llmquota.domain.cells import (
    at_capacity,
    sliced_bodies,
    summed,
    summed_ceilings,
    whole_ceilings,
)
from llmquota.domain.errors import InvalidRequest, StoreUnavailable
from llmquota.domain.keys import KeyOwner, key_digest
from llmquota.domain.plans import Ceiling, StoredCeiling
from llmquota.store.budget_moves import Undelivered
from llmquota.store.cells import cell_named_in, in_cell, script_in_cell


@pytest.mark.parametrize(
    ("method", "path", "route"),
    [
        ("POST", "/v1/admit", Route("caller")),
        ("POST", "/v1/tokens/count", Route("caller")),
        ("POST", "/v1/chat/completions", Route("key")),
        ("POST", "/v1/messages", Route("key")),
        ("POST", "/v1/reservations/abc/settle", Route("reservation")),
        ("POST", "/v1/reservations/abc/heartbeat", Route("reservation")),
        ("GET", "/v1/tenants/acme/status", Route("tenant", "acme")),
        ("PUT", "/v1/tenants/acme/policy", Route("tenant", "acme")),
        ("DELETE", "/v1/tenants/acme", Route("tenant", "acme")),
        ("PUT", "/v1/policies/global", Route("split")),
        ("PATCH", "/v1/ceilings/openai", Route("split")),
        ("GET", "/v1/ceilings/openai", Route("summed")),
        ("DELETE", "/v1/ceilings/openai", Route("every")),
        ("PUT", "/v1/plans/pro", Route("every")),
        ("GET", "/v1/plans", Route("first")),
        ("DELETE", "/v1/webhooks/ops", Route("every")),
        ("GET", "/openapi.json", Route("first")),
        ("GET", "/healthz", Route("health")),
        ("GET", "/metrics", Route("metrics")),
        ("GET", "/v1/tenants", Route("listing")),
        ("GET", "/v1/ceilings", Route("summed")),
        ("GET", "/v1/ceilings/openai/oversubscription", Route("unserved")),
        ("POST", "/v1/admin/keys", Route("unserved")),
        ("GET", "/console", Route("unserved")),
    ],
)
def test_each_path_finds_its_cell_by_its_rule(method: str, path: str, route: Route) -> None:
    assert route_of(method, path) == route


def test_the_anthropic_sdks_key_header_counts_as_a_bearer_token() -> None:
    assert authorization_of([(b"x-api-key", b"lq_1")]) == "Bearer lq_1"
    assert authorization_of([(b"authorization", b"Bearer lq_2"), (b"x-api-key", b"x")]) == (
        "Bearer lq_2"
    )
    assert authorization_of([]) is None


def test_a_shared_limits_body_is_split_so_that_the_slices_add_up() -> None:
    body = {"tokens_per_minute": 7, "token_burst": 10_001, "failure_mode": "open"}
    first, second, third = sliced_bodies(body, 3)
    assert first == {"tokens_per_minute": 3, "token_burst": 3_334, "failure_mode": "open"}
    assert second == {"tokens_per_minute": 2, "token_burst": 3_334, "failure_mode": "open"}
    assert third == {"tokens_per_minute": 2, "token_burst": 3_333, "failure_mode": "open"}
    # A merge patch's null (no limit) and a value no cell would take go as they are.
    patch = {"token_burst": None, "max_in_flight": "many"}
    assert sliced_bodies(patch, 2) == [patch, patch]
    with pytest.raises(InvalidRequest, match="number of cells"):
        sliced_bodies({"tokens_per_minute": 1}, 2)


def test_the_cells_answers_add_up_to_the_whole_limit_and_its_balance() -> None:
    answers: list[dict[str, object]] = [
        {
            "ceiling": "c",
            "token_burst": 600,
            "remaining_tokens": 300,
            "utilization": 0.5,
            "max_in_flight": None,
            "policy_version": 4,
        },
        {
            "ceiling": "c",
            "token_burst": 400,
            "remaining_tokens": 400,
            "utilization": 0.0,
            "max_in_flight": None,
            "policy_version": 2,
        },
    ]
    whole = summed(answers)
    assert whole["token_burst"] == 1_000 and whole["remaining_tokens"] == 700
    assert whole["utilization"] == 0.3
    assert whole["max_in_flight"] is None and whole["policy_version"] == 4


def test_the_ceilings_listing_adds_up_each_ceiling_by_name() -> None:
    first = {"ceilings": [{"ceiling": "a", "token_burst": 5}, {"ceiling": "b", "token_burst": 1}]}
    second = {"ceilings": [{"ceiling": "b", "token_burst": 2}, {"ceiling": "a", "token_burst": 4}]}
    assert summed_ceilings([first, second]) == {
        "ceilings": [{"ceiling": "a", "token_burst": 9}, {"ceiling": "b", "token_burst": 3}]
    }
    lacking = {"ceilings": [{"ceiling": "a", "token_burst": 4}]}
    assert summed_ceilings([first, lacking])["ceilings"][1] == {"ceiling": "b", "token_burst": 1}


def _stored(name: str, burst: int, tokens: float, seconds: int, **limits: Any) -> StoredCeiling:
    ceiling = Ceiling(models=["gpt-4o"], token_burst=burst, tokens_per_minute=burst, **limits)
    read_at = datetime(2026, 12, 6, 12, 0, seconds, tzinfo=UTC)
    return StoredCeiling(name, ceiling, 7, tokens, None, 2, read_at)


def test_a_ceilings_alerts_watch_its_slices_added_up() -> None:
    cells = [
        [_stored("openai", 5_000, 500.0, 1, max_in_flight=4), _stored("new", 10, 10.0, 1)],
        [_stored("openai", 5_000, 4_500.0, 3, max_in_flight=5)],  # `new` not written here yet
    ]
    openai, new = whole_ceilings(cells)
    assert (openai.name, openai.ceiling.token_burst, openai.ceiling.max_in_flight) == (
        "openai",
        10_000,
        9,
    )
    assert (openai.tokens, openai.requests, openai.in_flight) == (5_000.0, None, 4)
    assert openai.utilization == pytest.approx(0.5)  # cell 1's slice alone: 0.9
    assert openai.read_at == datetime(2026, 12, 6, 12, 0, 3, tzinfo=UTC)
    assert (openai.ceiling.request_burst, openai.ceiling.models) == (None, ["gpt-4o"])
    assert (new.ceiling.token_burst, new.tokens, new.utilization) == (10, 10.0, 0.0)
    assert whole_ceilings([]) == []


def test_room_the_rebalancer_is_moving_counts_with_its_sender() -> None:
    # Cell 2 sent 4,000 tokens to cell 1, debited but not yet credited: in
    # neither balance, 40% of the ceiling that is not in use.
    cells = [[_stored("openai", 5_000, 500.0, 1)], [_stored("openai", 5_000, 1_000.0, 1)]]
    (moving,) = whole_ceilings(cells, [{}, {"openai": (4_000.0, 0.0)}])
    assert moving.tokens == 5_500.0 and moving.utilization == pytest.approx(0.45)
    (unseen,) = whole_ceilings(cells)
    assert unseen.utilization == pytest.approx(0.85)


def test_slices_written_apart_add_up_by_the_capacity_each_has() -> None:
    # A write adding a token burst reached cell 2 first: cell 1 still has a
    # minute of refill as its capacity, cell 2 the burst.
    without = Ceiling(models=["gpt-4o"], tokens_per_minute=50_000)
    with_burst = Ceiling(models=["gpt-4o"], tokens_per_minute=50_000, token_burst=10_000)
    read_at = datetime(2026, 12, 6, tzinfo=UTC)
    (whole,) = whole_ceilings(
        [
            [StoredCeiling("openai", without, 1, 50_000.0, None, 0, read_at)],
            [StoredCeiling("openai", with_burst, 2, 10_000.0, None, 0, read_at)],
        ]
    )
    assert whole.ceiling.effective_token_burst == 60_000 and whole.utilization == 0.0


def test_a_whole_number_written_as_a_float_is_split_too() -> None:
    """The API takes 100000.0 as 100000: unsplit, every cell would hold it all."""
    assert sliced_bodies({"tokens_per_minute": 5.0, "token_burst": 1.5}, 2) == [
        {"tokens_per_minute": 3, "token_burst": 1.5},
        {"tokens_per_minute": 2, "token_burst": 1.5},
    ]


def test_the_cell_a_dsn_names_is_read_from_its_search_path() -> None:
    assert cell_named_in(in_cell("postgresql://u@h/db", "cell_2")) == "cell_2"
    assert cell_named_in(in_cell("postgresql://u@h/db?sslmode=off", "cell_12")) == "cell_12"
    assert cell_named_in("postgresql://u@h/db") is None
    assert cell_named_in("postgresql://u@h/db?search_path=app") is None


def _page(names: list[str], more: bool) -> dict[str, object]:
    return {"tenants": [{"tenant": n} for n in names], "next_cursor": "x" if more else None}


def test_the_tenant_directory_over_cells_pages_through_every_tenant_once() -> None:
    """Three cells' tenants, pages of 2: each turn takes the smallest head, so
    each cell's part of a page is a prefix of its own page, and the cursor
    says where each cell stands."""
    cells = [["a", "d", "g"], ["b", "c"], ["e"]]
    places = places_of(None, 3)
    seen: list[str] = []
    for _ in range(10):
        pages: list[dict[str, Any] | None] = []
        for names, place in zip(cells, places, strict=True):
            if place is False:
                pages.append(None)
                continue
            rest = [n for n in names if place is None or n > str(place)]
            pages.append(_page(rest[:2], len(rest) > 2))
        merged = merged_page(places, pages, 2)
        seen += [t["tenant"] for t in merged["tenants"]]
        if merged["next_cursor"] is None:
            break
        places = places_of(merged["next_cursor"], 3)
    assert seen == ["a", "b", "c", "d", "e", "g"]
    # A cursor of one database is each cell's place; anything else is refused.
    assert places_of(encode_cursor("m"), 2) == ["m", "m"]
    hostile = [
        "cells.bm90IGpzb24",  # not JSON
        "cells." + base64.urlsafe_b64encode(b"[false,false]").decode(),  # a finished listing
        "cells." + base64.urlsafe_b64encode(b"[" * 5_000).decode(),  # nested past recursion
        "cells." + "A" * 20_000,  # too long to be one of ours
        "cells." + base64.urlsafe_b64encode(b'["a b",null]').decode(),  # not a name
    ]
    for cursor in hostile:
        with pytest.raises(InvalidRequest, match="cursor"):
            places_of(cursor, 2)


async def test_a_key_is_looked_up_once_and_a_cell_that_fails_is_passed_over() -> None:
    """Cell 1 is down; the key lives in cell 2: found there, once for three
    requests at once, and the client's failed-authentication budget is paid back."""
    asked: list[int] = []

    def lookup(cell: int, holds: bool, down: bool = False) -> KeyLookup:
        async def find(digest: bytes) -> KeyOwner | None:
            asked.append(cell)
            await asyncio.sleep(0.01)
            if down:
                raise StoreUnavailable(f"cell {cell + 1} is down")
            return KeyOwner(key_id=1, tenant="acme") if holds and digest == held else None

        return find

    held = key_digest("lq_k")
    settings = Settings(auth_failure_burst=1, _env_file=None)  # type: ignore[call-arg]
    keys = KeyCells([lookup(0, False, down=True), lookup(1, True), lookup(2, False)], settings)
    cells = await asyncio.gather(*(keys.cell_of("Bearer lq_k", "10.0.0.1") for _ in range(3)))
    assert cells == [1, 1, 1] and asked == [0, 1]
    assert await keys.cell_of("Bearer lq_k", "10.0.0.1") == 1 and asked == [0, 1]
    # A key none holds while a cell is down: that cell's service answers (503).
    assert await keys.cell_of("Bearer lq_unknown", "10.0.0.2") == 0
    # With every cell up: a key none holds costs the client its one failure,
    # and the next wrong key is refused here, before any lookup.
    keys = KeyCells([lookup(0, False), lookup(1, True), lookup(2, False)], settings)
    asked.clear()
    assert await keys.cell_of("Bearer lq_unknown", "10.0.0.1") == 0 and asked == [0, 1, 2]
    with pytest.raises(TooManyFailedAuthentications):
        await keys.cell_of("Bearer lq_other", "10.0.0.1")
    assert asked == [0, 1, 2]
    assert await keys.cell_of("Bearer lq_k", "10.0.0.3") == 1  # another client is not held


async def test_an_admin_key_stored_in_a_cell_is_refused_not_sent_to_that_cell() -> None:
    # Sent there, it wrote a shared limit whole into one cell (each holds a
    # slice) and decided other cells' tenants in that one.
    asked: list[int] = []

    def lookup(cell: int) -> KeyLookup:
        async def find(digest: bytes) -> KeyOwner | None:
            asked.append(cell)
            return KeyOwner(key_id=7, tenant=None) if cell == 1 and digest == stored else None

        return find

    stored = key_digest("lq_stored_admin")
    settings = Settings(auth_failure_burst=1, _env_file=None)  # type: ignore[call-arg]
    keys = KeyCells([lookup(0), lookup(1)], settings)
    for _ in range(3):  # looked up once, then remembered; the budget paid back each time
        with pytest.raises(StoredAdminKey):
            await keys.cell_of("Bearer lq_stored_admin", "10.0.0.1")
    assert asked == [0, 1]
    assert await keys.cell_of("Bearer lq_unknown", "10.0.0.1") == 0  # its one failure left


async def test_a_revoked_stored_admin_key_is_a_key_no_cell_holds_after_the_window() -> None:
    # Refused at the front, its revocation reached no cell's authenticator:
    # it stayed 403 until the process restarted.
    revoked = False
    stored = key_digest("lq_stored_admin")

    async def find(digest: bytes) -> KeyOwner | None:
        held = digest == stored and not revoked
        return KeyOwner(key_id=7, tenant=None) if held else None

    settings = Settings(key_negative_cache_seconds=0.05, _env_file=None)  # type: ignore[call-arg]
    keys = KeyCells([find, find], settings)
    with pytest.raises(StoredAdminKey):
        await keys.cell_of("Bearer lq_stored_admin", "10.0.0.1")
    revoked = True
    with pytest.raises(StoredAdminKey):  # within the window: remembered
        await keys.cell_of("Bearer lq_stored_admin", "10.0.0.1")
    await asyncio.sleep(0.06)
    assert await keys.cell_of("Bearer lq_stored_admin", "10.0.0.1") == 0  # cell 1 answers 401


class _FakeCell:
    """A cell's store as CeilingsOverCells reads it: its slices, its moves."""

    def __init__(self, tokens: list[float], moving: float = 0.0) -> None:
        self.tokens, self.moving, self.move_id = tokens, moving, uuid.uuid4()
        self.extra: list[StoredCeiling] = []
        self.catalog, self.budget_moves = self, self

    async def get_ceilings(
        self, name: str | None = None, *, deadline_seconds: float | None = None
    ) -> list[StoredCeiling]:
        return [_stored("openai", 5_000, self.tokens.pop(0), 1), *self.extra]

    async def undelivered(self, limit: int) -> list[Undelivered]:
        return (
            [Undelivered(self.move_id, "openai", "cell_1", self.moving, 0.0)] if self.moving else []
        )


async def test_a_crossing_over_cells_must_show_in_two_reads_in_a_row() -> None:
    # The second call's read raced a whole move (credited and confirmed
    # between the reads of the two cells): 90% for one read, not believed.
    slices = [4_000.0] * 2 + [500.0] * 2
    cells = [_FakeCell(list(slices)), _FakeCell(list(slices))]
    reader = CeilingsOverCells(cells)  # type: ignore[arg-type]
    first = (await reader.get_ceilings())[0].utilization  # two reads at once: none before
    raced = (await reader.get_ceilings())[0].utilization
    held = (await reader.get_ceilings())[0].utilization
    assert (first, raced, held) == (pytest.approx(0.2), pytest.approx(0.2), pytest.approx(0.9))
    assert cells[0].tokens == []


async def test_a_move_not_yet_confirmed_counts_with_its_sender_for_a_few_seconds() -> None:
    now = [0.0]
    sender = _FakeCell([500.0] * 6, moving=4_000.0)
    reader = CeilingsOverCells([_FakeCell([500.0] * 6), sender], lambda: now[0])  # type: ignore[list-item]
    assert (await reader.get_ceilings())[0].utilization == pytest.approx(0.5)
    # Stranded past IN_TRANSIT_SECONDS (a round cut short, no rebalancer since):
    # room neither slice admits from, as the ceiling's admissions see it.
    now[0] = IN_TRANSIT_SECONDS + 1
    await reader.get_ceilings()
    assert (await reader.get_ceilings())[0].utilization == pytest.approx(0.9)


def test_an_away_cells_slice_counts_as_full() -> None:
    last = _stored("openai", 5_000, 1_000.0, 0, requests_per_minute=60, request_burst=100)
    last = dataclasses.replace(last, requests=10.0, in_flight=3)
    away = at_capacity(last)
    # Whatever it admitted or was moved since, it holds no more than its capacity.
    assert (away.tokens, away.requests, away.in_flight) == (5_000.0, 100.0, 0)
    assert away.estimated and away.read_at == last.read_at
    (whole,) = whole_ceilings([[_stored("openai", 5_000, 0.0, 30)], [away]])
    assert whole.estimated and whole.utilization == pytest.approx(0.5)


async def test_a_ceiling_an_away_cells_last_read_lacked_samples_nothing() -> None:
    one, two = _FakeCell([500.0] * 4), _FakeCell([5_000.0] * 2)
    reader = CeilingsOverCells([one, two])  # type: ignore[list-item]
    assert (await reader.get_ceilings())[0].utilization == pytest.approx(0.45)

    # Cell 2 goes away; cell 1 gains a ceiling cell 2 was never read with.
    async def away(name: str | None = None, **_: Any) -> list[StoredCeiling]:
        raise StoreUnavailable("database unavailable")

    two.get_ceilings = away  # type: ignore[method-assign]
    newer = _stored("newer", 5_000, 0.0, 2)
    one.tokens = [500.0, 500.0]
    one.extra = [newer]
    openai, unknown = await reader.get_ceilings()
    assert openai.estimated and openai.utilization == pytest.approx(0.45)
    assert unknown.name == "newer" and unknown.estimated
    assert (unknown.tokens, unknown.utilization) == (None, None)
    assert ceiling_samples([unknown], AlertDefaults()) == []


def test_an_estimated_ceiling_samples_only_the_thresholds_it_has_certainly_crossed() -> None:
    ceiling = Ceiling(
        models=["gpt-4o"], tokens_per_minute=1, token_burst=10_000, alert_at=[0.3, 0.5, 0.8]
    )
    read_at = datetime(2026, 12, 6, tzinfo=UTC)
    at_60 = StoredCeiling("openai", ceiling, 1, 4_000.0, None, 0, read_at)
    exact = ceiling_samples([at_60], AlertDefaults())
    estimated = ceiling_samples([dataclasses.replace(at_60, estimated=True)], AlertDefaults())
    assert [float(s.threshold) for s in exact] == [0.3, 0.5, 0.8]
    assert [float(s.threshold) for s in estimated] == [0.3, 0.5]


class _Reader:
    def __init__(self, estimated: bool) -> None:
        self.estimated = estimated

    async def get_ceilings(
        self, name: str | None = None, *, deadline_seconds: float | None = None
    ) -> list[StoredCeiling]:
        return [dataclasses.replace(_stored("openai", 5_000, 0.0, 1), estimated=self.estimated)]


class _Alerts:
    def __init__(self) -> None:
        self.pruned = 0

    async def record_ceiling_samples(self, samples: list[Any]) -> list[Any]:
        return []

    async def prune_ceiling_alert_states(self, samples: list[Any], read_at: Any) -> None:
        self.pruned += 1


async def test_a_read_with_a_cell_away_prunes_no_episode_state() -> None:
    # It leaves samples out: pruning by them would forget episodes still open.
    alerts = _Alerts()
    reader = _Reader(estimated=True)
    detector = CeilingAlertDetector(reader, alerts)  # type: ignore[arg-type]
    await detector.run_once()
    assert alerts.pruned == 0
    reader.estimated = False
    await detector.run_once()
    assert alerts.pruned == 1


def test_a_script_run_in_a_cell_names_its_schemas_and_leaves_roles_alone() -> None:
    script = (
        "GRANT USAGE ON SCHEMA public TO llmquota_app;\n"
        "REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA public FROM PUBLIC;\n"
        "SET search_path = pg_catalog, public\n"
        "CREATE OR REPLACE FUNCTION reporting.usage_daily() ... FROM public.usage_ledger;\n"
        "GRANT USAGE ON SCHEMA reporting TO llmquota_reporting;\n"
        "SELECT 'public'::regnamespace, publicity, reporting_day;\n"
    )
    assert script_in_cell(script, "cell_3") == (
        "GRANT USAGE ON SCHEMA cell_3 TO llmquota_app;\n"
        "REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA cell_3 FROM PUBLIC;\n"
        "SET search_path = pg_catalog, cell_3\n"
        "CREATE OR REPLACE FUNCTION cell_3_reporting.usage_daily() ... FROM cell_3.usage_ledger;\n"
        "GRANT USAGE ON SCHEMA cell_3_reporting TO llmquota_reporting;\n"
        "SELECT 'cell_3'::regnamespace, publicity, reporting_day;\n"
    )
