"""llmquota.client against a real server over a socket: the library's API, over REST.

Each test runs the blocking `Client` and the asyncio `AsyncClient` through
the same scenario on a server of its own (tests/acceptance/client_support.py):
a uvicorn on a loopback port in front of a fresh database. What a test
asserts comes from the server: its status and usage endpoints, and the
answers the client got, as httpx's transport recorded them.

Limits are chosen so that a slow machine cannot change an outcome: a
limit that must refill within the wait refills 100 tokens a second (room is
3 s away: only a second request 3 s late would miss the refusal, and the
wait allowed is 30 s), and one that must not refills one token a second
(the hint is minutes away).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

import pytest

from llmquota import RateLimited, RequestTooLarge
from llmquota.client import (
    AsyncClient,
    AuthenticationFailed,
    Client,
    PermissionDenied,
)
from llmquota.domain.errors import InvalidRequest, ReservationConflict
from tests.acceptance.client_support import (
    AsyncRecordingTransport,
    Attempt,
    DroppingProxy,
    RecordingTransport,
    live_server,
    provision,
    tenant_layer,
    usage,
)
from tests.faults.proxy import PgProxy

TENANT = "acme"
BURST_TOKENS = 1_000
# 100 tokens a second: room for 300 tokens is 3 s away.
FAST_REFILL_PER_MINUTE = 6_000
# One token a second: room for 300 tokens is five minutes away.
SLOW_REFILL_PER_MINUTE = 60
LONG_WAIT_MS = 30_000


@pytest.fixture
def base(database_dsn: str) -> Iterator[str]:
    with live_server(database_dsn) as url:
        yield url


def _key(base: str, tokens_per_minute: int) -> str:
    return provision(base, TENANT, tokens_per_minute=tokens_per_minute, token_burst=BURST_TOKENS)


def _request(input_tokens: int, max_tokens: int) -> dict[str, Any]:
    return {
        "tenant": TENANT,
        "model": "gpt-4o",
        "input_tokens": input_tokens,
        "max_tokens": max_tokens,
    }


def _admits(attempts: list[Attempt]) -> list[Attempt]:
    return [a for a in attempts if a.path == "/v1/admit"]


# -- a round trip: admit, settle, and the ledger has it ----------------------


def _assert_settled_round_trip(base: str, reserved: int, charged: int, refunded: int) -> None:
    assert reserved == 100 + 400
    assert (charged, refunded) == (90 + 150, 500 - 240)
    ledger = usage(base, TENANT)
    assert (ledger["requests"], ledger["input_tokens"], ledger["output_tokens"]) == (1, 90, 150)
    layer = tenant_layer(base, TENANT)
    assert layer["in_flight"] == 0
    # The burst less what was charged (refill over the test: a few tokens at most).
    assert BURST_TOKENS - 240 <= layer["remaining_tokens"] < BURST_TOKENS - 200


def test_sync_admit_and_settle_reach_the_ledger(base: str) -> None:
    key = _key(base, SLOW_REFILL_PER_MINUTE)
    with Client(base, key) as client, client.reservation(**_request(100, 400)) as r:
        assert tenant_layer(base, TENANT)["in_flight"] == 1
        admitted_until = r.lease_expires_at
        assert r.heartbeat(lease_seconds=3_600) == r.lease_expires_at > admitted_until
        settlement = r.settle(input_tokens=90, output_tokens=150)
    assert r.settlement == settlement and not r.released
    _assert_settled_round_trip(
        base, r.reserved_tokens, settlement.charged_tokens, settlement.refunded_tokens
    )


async def test_async_admit_and_settle_reach_the_ledger(base: str) -> None:
    key = _key(base, SLOW_REFILL_PER_MINUTE)
    async with AsyncClient(base, key) as client, client.reservation(**_request(100, 400)) as r:
        assert tenant_layer(base, TENANT)["in_flight"] == 1
        admitted_until = r.lease_expires_at
        assert await r.heartbeat(lease_seconds=3_600) == r.lease_expires_at > admitted_until
        settlement = await r.settle(input_tokens=90, output_tokens=150)
    assert r.settlement == settlement and not r.released
    _assert_settled_round_trip(
        base, r.reserved_tokens, settlement.charged_tokens, settlement.refunded_tokens
    )


# -- a refusal is the library's RateLimited, with the server's figures -------


def _assert_is_the_servers_refusal(refused: RateLimited, attempts: list[Attempt]) -> None:
    """One attempt, answered 429, whose body and headers the exception carries."""
    (attempt,) = _admits(attempts)
    error = attempt.body["error"]
    assert attempt.status == 429 and error["type"] == "rate_limit_error"
    assert (
        (refused.limit, refused.scope) == (error["limit"], error["scope"]) == ("tokens", "tenant")
    )
    assert refused.retry_after_ms == error["retry_after_ms"]
    assert refused.retry_after_ms == int(attempt.headers["retry-after-ms"])
    assert refused.retry_after == refused.retry_after_ms / 1000
    assert str(refused) == refused.message == error["message"]
    # 300 tokens at one a second: minutes, far past the 2 s the caller would wait.
    assert refused.retry_after_ms > 200_000


def test_sync_refusal_past_the_wait_is_raised_at_once_with_the_servers_fields(base: str) -> None:
    key = _key(base, SLOW_REFILL_PER_MINUTE)
    transport = RecordingTransport()
    with Client(base, key, transport=transport) as client:
        held = client.admit(**_request(500, 500))
        with pytest.raises(RateLimited) as refused:
            client.admit(max_wait_ms=2_000, **_request(100, 200))
        first_admit = transport.attempts.pop(0)
        _assert_is_the_servers_refusal(refused.value, transport.attempts)
        held.release()
    assert first_admit.status == 201


async def test_async_refusal_past_the_wait_is_raised_at_once_with_the_servers_fields(
    base: str,
) -> None:
    key = _key(base, SLOW_REFILL_PER_MINUTE)
    transport = AsyncRecordingTransport()
    async with AsyncClient(base, key, transport=transport) as client:
        held = await client.admit(**_request(500, 500))
        with pytest.raises(RateLimited) as refused:
            await client.admit(max_wait_ms=2_000, **_request(100, 200))
        first_admit = transport.attempts.pop(0)
        _assert_is_the_servers_refusal(refused.value, transport.attempts)
        await held.release()
    assert first_admit.status == 201


# -- a refusal that room will outlive is waited out, at the server's hint ----


def _assert_waited_at_the_hints(attempts: list[Attempt]) -> None:
    """Refused one or more times, then admitted; never tried again before the hint."""
    admits = _admits(attempts)
    assert [a.status for a in admits[:2]] == [201, 429]
    assert admits[-1].status == 201 and {a.status for a in admits[1:-1]} == {429}
    for refused, next_try in itertools.pairwise(admits[1:]):
        hint_ms = int(refused.headers["retry-after-ms"])
        # 300 tokens at 100 a second: about 3 s, well inside the 30 s wait.
        assert 0 < hint_ms <= 3_000
        waited_ms = (next_try.sent_at - refused.answered_at) * 1000
        assert waited_ms >= hint_ms, (waited_ms, hint_ms)


def test_sync_rate_limit_is_waited_out_within_max_wait_ms(base: str) -> None:
    key = _key(base, FAST_REFILL_PER_MINUTE)
    transport = RecordingTransport()
    with Client(base, key, transport=transport) as client:
        client.admit(**_request(500, 500))  # the whole burst: the next one must wait
        with client.reservation(max_wait_ms=LONG_WAIT_MS, **_request(100, 200)) as r:
            assert r.reserved_tokens == 300
    _assert_waited_at_the_hints(transport.attempts)


async def test_async_rate_limit_is_waited_out_within_max_wait_ms(base: str) -> None:
    key = _key(base, FAST_REFILL_PER_MINUTE)
    transport = AsyncRecordingTransport()
    async with AsyncClient(base, key, transport=transport) as client:
        await client.admit(**_request(500, 500))
        async with client.reservation(max_wait_ms=LONG_WAIT_MS, **_request(100, 200)) as r:
            assert r.reserved_tokens == 300
    _assert_waited_at_the_hints(transport.attempts)


# -- a block left without settling releases ------------------------------------


def test_sync_block_left_unsettled_releases_even_on_an_exception(base: str) -> None:
    key = _key(base, SLOW_REFILL_PER_MINUTE)
    with Client(base, key) as client:
        with client.reservation(**_request(100, 400)) as quiet:
            assert tenant_layer(base, TENANT)["remaining_tokens"] <= BURST_TOKENS - 500
        with pytest.raises(ZeroDivisionError), client.reservation(**_request(100, 400)) as loud:
            _ = 1 / 0
        with pytest.raises(ReservationConflict) as late:
            client.settle(quiet.reservation_id, input_tokens=100, output_tokens=1)
    assert quiet.released and loud.released
    assert late.value.state == "released"
    layer = tenant_layer(base, TENANT)
    assert (layer["remaining_tokens"], layer["in_flight"]) == (BURST_TOKENS, 0)
    assert usage(base, TENANT)["requests"] == 0


async def test_async_block_left_unsettled_releases_even_when_cancelled(base: str) -> None:
    key = _key(base, SLOW_REFILL_PER_MINUTE)
    inside = asyncio.Event()

    async def hold(client: AsyncClient) -> None:
        async with client.reservation(**_request(100, 400)):
            inside.set()
            await asyncio.Event().wait()  # until cancelled

    async with AsyncClient(base, key) as client:
        task = asyncio.create_task(hold(client))
        await inside.wait()
        assert tenant_layer(base, TENANT)["in_flight"] == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        with pytest.raises(ZeroDivisionError):
            async with client.reservation(**_request(100, 400)) as loud:
                _ = 1 / 0
        with pytest.raises(ReservationConflict) as late:
            await client.settle(loud.reservation_id, input_tokens=100, output_tokens=1)
    assert late.value.state == "released"
    layer = tenant_layer(base, TENANT)
    assert (layer["remaining_tokens"], layer["in_flight"]) == (BURST_TOKENS, 0)
    assert usage(base, TENANT)["requests"] == 0


# -- answers that cannot change are never retried --------------------------


def _assert_one_attempt_each(attempts: list[Attempt], statuses: list[int]) -> None:
    assert [a.status for a in attempts] == statuses


def test_sync_too_large_bad_input_and_bad_keys_are_raised_after_one_attempt(base: str) -> None:
    key = _key(base, FAST_REFILL_PER_MINUTE)
    transport = RecordingTransport()
    with Client(base, key, transport=transport) as client:
        with pytest.raises(RequestTooLarge) as too_large:
            client.admit(max_wait_ms=LONG_WAIT_MS, **_request(1_500, 500))
        with pytest.raises(InvalidRequest):
            client.admit(**_request(-1, 500))
        with pytest.raises(PermissionDenied):
            client.admit(**(_request(1, 1) | {"tenant": "someone-else"}))
    with (
        Client(base, "lq_not_a_key", transport=transport) as stranger,
        pytest.raises(AuthenticationFailed),
    ):
        stranger.admit(**_request(1, 1))
    big = too_large.value
    assert (big.scope, big.requested, big.capacity) == ("tenant", 2_000, BURST_TOKENS)
    _assert_one_attempt_each(transport.attempts, [413, 422, 403, 401])


async def test_async_too_large_bad_input_and_bad_keys_are_raised_after_one_attempt(
    base: str,
) -> None:
    key = _key(base, FAST_REFILL_PER_MINUTE)
    transport = AsyncRecordingTransport()
    async with AsyncClient(base, key, transport=transport) as client:
        with pytest.raises(RequestTooLarge) as too_large:
            await client.admit(max_wait_ms=LONG_WAIT_MS, **_request(1_500, 500))
        with pytest.raises(InvalidRequest):
            await client.admit(**_request(-1, 500))
        with pytest.raises(PermissionDenied):
            await client.admit(**(_request(1, 1) | {"tenant": "someone-else"}))
    async with AsyncClient(base, "lq_not_a_key", transport=transport) as stranger:
        with pytest.raises(AuthenticationFailed):
            await stranger.admit(**_request(1, 1))
    big = too_large.value
    assert (big.scope, big.requested, big.capacity) == ("tenant", 2_000, BURST_TOKENS)
    _assert_one_attempt_each(transport.attempts, [413, 422, 403, 401])


# -- an admission whose answer was lost is retried, and admitted once ------


def _assert_admitted_once(base: str, proxy: DroppingProxy, reservation_id: str) -> None:
    (lost,) = proxy.dropped
    # The server admitted the first attempt; the retry got that same reservation back.
    assert lost["reservation_id"] == reservation_id
    layer = tenant_layer(base, TENANT)
    assert layer["in_flight"] == 1
    assert BURST_TOKENS - 500 <= layer["remaining_tokens"] < BURST_TOKENS - 450


def test_sync_admission_retried_after_a_dropped_connection_is_admitted_once(base: str) -> None:
    key = _key(base, SLOW_REFILL_PER_MINUTE)
    proxy = DroppingProxy(base, drops=1)
    try:
        with Client(proxy.base, key) as client, client.reservation(**_request(100, 400)) as r:
            _assert_admitted_once(base, proxy, str(r.reservation_id))
            r.settle(input_tokens=100, output_tokens=10)
    finally:
        proxy.close()
    assert usage(base, TENANT)["requests"] == 1


async def test_async_admission_retried_after_a_dropped_connection_is_admitted_once(
    base: str,
) -> None:
    key = _key(base, SLOW_REFILL_PER_MINUTE)
    proxy = DroppingProxy(base, drops=1)
    try:
        async with (
            AsyncClient(proxy.base, key) as client,
            client.reservation(**_request(100, 400)) as r,
        ):
            _assert_admitted_once(base, proxy, str(r.reservation_id))
            await r.settle(input_tokens=100, output_tokens=10)
    finally:
        proxy.close()
    assert usage(base, TENANT)["requests"] == 1


# -- a 503 (the server's database hangs) is retried, never before Retry-After --

# Short enough that a hung database answers 503 soon; long enough that a
# healthy decision on a loaded machine is not one.
OUTAGE_DEADLINE_MS = 1_000


@pytest.mark.parametrize("flavour", ["sync", "async"])
async def test_a_503_is_retried_after_its_retry_after_until_the_database_is_back(
    database_dsn: str, flavour: str
) -> None:
    proxy = await PgProxy(database_dsn).start()
    # The proxy runs on this loop, so everything that blocks on the server runs
    # in a thread: the server's start and stop, and the admin's set-up.
    stack = contextlib.ExitStack()
    try:
        server = live_server(proxy.dsn, decision_deadline_ms=OUTAGE_DEADLINE_MS)
        url = await asyncio.to_thread(stack.enter_context, server)
        key = await asyncio.to_thread(_key, url, SLOW_REFILL_PER_MINUTE)
        proxy.pause()  # the database stops answering: closed layers answer 503
        attempts = await _admit_through_an_outage(url, key, proxy, flavour)
    finally:
        await asyncio.to_thread(stack.close)
        await proxy.close()
    statuses = [a.status for a in attempts]
    assert statuses[0] == 503 and statuses[-1] == 201 and set(statuses[:-1]) == {503}
    for refused, next_try in itertools.pairwise(attempts):
        hint_seconds = int(refused.headers["retry-after"])
        assert hint_seconds == 1
        assert next_try.sent_at - refused.answered_at >= hint_seconds


async def _admit_through_an_outage(
    url: str, key: str, proxy: PgProxy, flavour: str
) -> list[Attempt]:
    """Admit with the database hung; bring it back once the client has had a 503."""
    if flavour == "sync":
        transport: RecordingTransport | AsyncRecordingTransport = RecordingTransport()
        client = Client(url, key, max_retries=10, transport=transport)

        async def admit() -> None:
            with client:  # blocking, so in a thread: the loop keeps the proxy running
                await asyncio.to_thread(client.admit, **_request(100, 400))
    else:
        transport = AsyncRecordingTransport()
        async_client = AsyncClient(url, key, max_retries=10, transport=transport)

        async def admit() -> None:
            async with async_client:
                await async_client.admit(**_request(100, 400))

    task = asyncio.create_task(admit())
    while not transport.attempts:
        assert not task.done(), task
        await asyncio.sleep(0.05)
    proxy.resume()
    await task
    return transport.attempts
