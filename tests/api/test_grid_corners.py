"""Seed 004's load grid, its corners kept in the suite: which limit binds, and what the other reads.

Each cell offers one minute of traffic through POST /v1/admit (the real app
and database) and reads the tenant's buckets back from GET
/v1/tenants/{t}/status and from the stored row: the refusal names the limit
that bound (`error.limit`), and the other limit's reading is its
utilization, 1 - remaining / burst, in percent.

The grid's limits. Seed 004 states the request limit, 4,000 a minute, and
its draft corner fixes the token limit: "at 200 requests per minute of
3,000-token drafts the token bucket refuses while the request counter reads
5%" -- 200 / 4,000 is 5%, and the minute's tokens run out at the 201st
draft when the bucket holds 200 x 3,000 = 600,000. So: 600,000 tokens and
4,000 requests a minute, each burst a minute's worth (the default).

What seed 004 gets wrong. Its verdict corner says the token bucket "reads
24%" when the request counter refuses 8,000 one-word verdicts a minute
(60 + 40 input tokens, max_tokens 12: 112 tokens each). No pair of limits
gives both readings. With capacities C_t tokens and C_r requests, the draft
corner has 5% of C_r drafts take all of C_t: C_t = 0.05 x C_r x 3,000 =
150 C_r. The verdict corner has C_r verdicts take C_r x 112 of it: 112 / 150
= 74.67%, whatever C_r is. 24% needs C_t = 112 / 0.24 = 467 C_r, 1,866,667
tokens at 4,000 requests, where 200 drafts take 600,000 tokens, 32%, and
nothing refuses them. (The seed's 24% is its moderation customer's
dashboard, another allocation than its grid's.) So the verdict corner
asserts what this grid reads, 4,000 x 112 = 448,000 of 600,000 tokens,
74.67%, while requests refuse: either way the token bucket is not the
constraint, which is the corner's point.

The third corner adds a concurrency cap to the same grid: seed 004's "40
requests a minute of 8,000-token generations ... inside both rate limits"
with at most 30 in flight (the seed's 30 simultaneous requests, the most the
cap allows): the 31st is refused for concurrency while tokens read
30 x 8,000 / 600,000 = 40% and requests 30 / 4,000 = 0.75%; a release frees
a permit for the next. The middle of the grid, 1,000 requests a minute of
300 tokens, is refused by nothing and reads 50% and 25%.

On the database clock, without waiting a minute: the tenant's layer is
marked refilled an hour ahead (`_hold_the_minute`). Admission reads its time
as the later of the clock and a layer's last refill, so for these requests
the database clock stands still at that mark: no refill accrues while the
burst runs and every reading is exact. The minute's traffic then arrives as
one burst, as fast as the app takes it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from fractions import Fraction

import asyncpg
import httpx

from tests.api.conftest import make_tenant
from tests.integration.support import raw_layer

TENANT = "acme"
TOKENS_PER_MINUTE = 600_000
REQUESTS_PER_MINUTE = 4_000
# Requests in flight at once from the test: under the fair share's queue
# (TENANT_MAX_QUEUED, 256), so that every answer is the limiter's decision.
CONCURRENT = 100


@dataclass(frozen=True)
class Cell:
    """One cell of the grid: a minute's requests and what each reserves."""

    requests: int
    input_tokens: int
    max_tokens: int

    @property
    def body(self) -> dict[str, object]:
        return {
            "tenant": TENANT,
            "model": "gpt-4o",
            "input_tokens": self.input_tokens,
            "max_tokens": self.max_tokens,
        }


DRAFTS = Cell(requests=201, input_tokens=200, max_tokens=2_800)  # 3,000 each; 200 a minute fit
VERDICTS = Cell(requests=4_001, input_tokens=100, max_tokens=12)  # 112 each; 8,000 offered
MIDDLE = Cell(requests=1_000, input_tokens=100, max_tokens=200)  # 300 each
GENERATIONS = Cell(requests=40, input_tokens=1_000, max_tokens=7_000)  # 8,000 each


async def _grid_tenant(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection, **extra: int
) -> dict[str, str]:
    headers = await make_tenant(
        client,
        admin,
        TENANT,
        tokens_per_minute=TOKENS_PER_MINUTE,
        requests_per_minute=REQUESTS_PER_MINUTE,
        **extra,
    )
    await _hold_the_minute(db)
    return headers


async def _hold_the_minute(db: asyncpg.Connection) -> None:
    """No refill until an hour from now: the buckets read what the burst took, exactly."""
    await db.execute(
        "UPDATE limit_layers SET refilled_at = clock_timestamp() + interval '1 hour'"
        " WHERE tenant = $1",
        TENANT,
    )


async def _offer(
    client: httpx.AsyncClient, headers: dict[str, str], cell: Cell
) -> list[httpx.Response]:
    """The cell's minute of requests: the first alone (the worker learns the key), then
    CONCURRENT at a time."""
    answers = [await client.post("/v1/admit", json=cell.body, headers=headers)]
    for start in range(1, cell.requests, CONCURRENT):
        batch = min(CONCURRENT, cell.requests - start)
        answers += await asyncio.gather(
            *(client.post("/v1/admit", json=cell.body, headers=headers) for _ in range(batch))
        )
    return answers


@dataclass(frozen=True)
class Readings:
    """The tenant layer's utilization of each limit, in percent, and what is in flight."""

    tokens_pct: Fraction
    requests_pct: Fraction
    in_flight: int


async def _readings(client: httpx.AsyncClient, admin: dict[str, str]) -> Readings:
    response = await client.get(f"/v1/tenants/{TENANT}/status", headers=admin)
    assert response.status_code == 200, response.text
    (layer,) = response.json()["layers"]
    limits = layer["limits"]
    return Readings(
        tokens_pct=100 - Fraction(100 * layer["remaining_tokens"], limits["token_burst"]),
        requests_pct=100 - Fraction(100 * layer["remaining_requests"], limits["request_burst"]),
        in_flight=layer["in_flight"],
    )


def _outcomes(answers: list[httpx.Response]) -> tuple[int, list[dict[str, object]]]:
    """How many were admitted, and the refusals' error bodies."""
    admitted = sum(a.status_code == 201 for a in answers)
    refused = [a.json()["error"] for a in answers if a.status_code != 201]
    assert all(a.status_code in (201, 429) for a in answers), {a.status_code for a in answers}
    return admitted, refused


async def test_drafts_corner_the_token_bucket_refuses_while_requests_read_5_percent(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection
) -> None:
    headers = await _grid_tenant(client, admin, db)
    admitted, refused = _outcomes(await _offer(client, headers, DRAFTS))
    # 200 x 3,000 = 600,000: the minute's tokens; the 201st draft is refused for tokens
    assert admitted == 200
    assert [(e["limit"], e["scope"]) for e in refused] == [("tokens", "tenant")]
    readings = await _readings(client, admin)
    assert readings.requests_pct == 5  # 200 / 4,000
    assert readings.tokens_pct == 100
    row = await raw_layer(db, "tenant", TENANT)
    assert (row["tokens"], row["requests"]) == (0, REQUESTS_PER_MINUTE - 200)


async def test_verdicts_corner_the_request_counter_refuses_while_tokens_read_low(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection
) -> None:
    headers = await _grid_tenant(client, admin, db)
    admitted, refused = _outcomes(await _offer(client, headers, VERDICTS))
    # the minute's 4,000 requests; the 4,001st verdict is refused for requests
    assert admitted == 4_000, refused[:3]
    assert [(e["limit"], e["scope"]) for e in refused] == [("requests", "tenant")]
    readings = await _readings(client, admin)
    assert readings.requests_pct == 100
    # 4,000 x 112 = 448,000 of 600,000 (the module's docstring: not seed 004's 24%)
    assert readings.tokens_pct == Fraction(448_000 * 100, 600_000)
    assert round(float(readings.tokens_pct), 2) == 74.67
    row = await raw_layer(db, "tenant", TENANT)
    assert (row["tokens"], row["requests"]) == (600_000 - 448_000, 0)


async def test_the_middle_of_the_grid_binds_nothing(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection
) -> None:
    headers = await _grid_tenant(client, admin, db)
    admitted, refused = _outcomes(await _offer(client, headers, MIDDLE))
    assert (admitted, refused) == (1_000, [])
    readings = await _readings(client, admin)
    assert (readings.tokens_pct, readings.requests_pct) == (50, 25)  # 300,000 and 1,000


async def test_long_generations_corner_concurrency_refuses_while_both_rates_read_low(
    client: httpx.AsyncClient, admin: dict[str, str], db: asyncpg.Connection
) -> None:
    headers = await _grid_tenant(client, admin, db, max_in_flight=30)
    answers = await _offer(client, headers, GENERATIONS)
    admitted, refused = _outcomes(answers)
    assert admitted == 30
    assert {(e["limit"], e["scope"]) for e in refused} == {("concurrency", "tenant")}
    assert len(refused) == 10
    readings = await _readings(client, admin)
    assert readings.in_flight == 30
    assert readings.tokens_pct == 40  # 30 x 8,000 = 240,000 of 600,000
    assert readings.requests_pct == Fraction(3, 4)  # 30 of 4,000: 0.75%
    # a generation that ends frees its permit, and the next one is admitted (released,
    # not settled: a settle would stamp its ledger row by the clock, before the held minute)
    first = next(a.json()["reservation_id"] for a in answers if a.status_code == 201)
    released = await client.post(f"/v1/reservations/{first}/release", headers=headers)
    assert released.status_code == 200, released.text
    again = await client.post("/v1/admit", json=GENERATIONS.body, headers=headers)
    assert again.status_code == 201, again.text
    assert (await _readings(client, admin)).in_flight == 30
