"""The lane of unknown keys takes one place per key: a key's first request
looks it up, and the key's other requests wait until that one is through
its lookup, then are triaged once more (api/fairness.py).

Driven through the middleware's ASGI interface with a triage and an app of
the test's own, which plays the authenticator's part (KEY_LOOKED_UP once its
"lookup" is over), so that the lookup's moment and outcome are the test's.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter

from starlette.types import Message, Receive, Scope, Send

from llmquota.api.auth import KEY_LOOKED_UP, UNKNOWN_KEYS_LANE, Triage
from llmquota.api.fairness import TenantFairShare

KEY = b"digest of a key the worker has not seen"


class Lookup:
    """An app whose requests look the key up until the test lets the lookup end;
    found, or not (the store away: 503, and the key stays unknown)."""

    def __init__(
        self, *, store_answers: bool = True, lookup_s: float = 0.0, first_after_s: float = 0.001
    ) -> None:
        self.found = False
        self.store_answers = store_answers
        # How long a lookup takes once the test lets it end (the store away: its deadline).
        self.lookup_s = lookup_s
        # How long the first request goes on after its lookup (the others: 1 ms).
        self.first_after_s = first_after_s
        self.may_end = asyncio.Event()
        self.lookups = 0
        self.served = 0
        self.serving = 0
        self.most_serving = 0
        self.unknown_at_once = 0
        self.most_unknown_at_once = 0

    def triage(self, scope: Scope) -> Triage:
        if self.found:
            return Triage(lane="acme")
        return Triage(lane=UNKNOWN_KEYS_LANE, key=KEY)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.serving += 1
        self.most_serving = max(self.most_serving, self.serving)
        try:
            status = await self._serve(scope)
            await send({"type": "http.response.start", "status": status, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})
        finally:
            self.serving -= 1

    async def _serve(self, scope: Scope) -> int:
        if not self.found:
            self.lookups += 1
            self.unknown_at_once += 1
            self.most_unknown_at_once = max(self.most_unknown_at_once, self.unknown_at_once)
            first = self.lookups == 1
            try:
                await self.may_end.wait()
                await asyncio.sleep(self.lookup_s)
            finally:
                self.unknown_at_once -= 1
            self.found = self.store_answers
            looked_up = scope.get(KEY_LOOKED_UP)
            if looked_up is not None:
                looked_up()
            if not self.found:
                return 503
            await asyncio.sleep(self.first_after_s if first else 0.001)  # the admission
        else:
            await asyncio.sleep(0.001)
        self.served += 1
        return 200


def share(app: Lookup, max_waiting: int = 256) -> TenantFairShare:
    return TenantFairShare(
        app,
        triage=app.triage,
        max_in_progress=32,
        max_waiting=max_waiting,
        unknown_max_in_progress=4,
        unknown_max_waiting=64,
    )


async def request(middleware: TenantFairShare) -> tuple[int, dict[str, object]]:
    """One request through the middleware: its status and JSON body."""
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    scope: Scope = {"type": "http", "path": "/v1/admit", "headers": []}
    await middleware(scope, receive, send)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return int(sent[0]["status"]), json.loads(body)


def statuses(answers: list[tuple[int, dict[str, object]]]) -> Counter[int]:
    return Counter(status for status, _ in answers)


async def test_a_keys_first_burst_waits_for_one_lookup_and_is_served_whole() -> None:
    # 200 requests with one new key: the unknown lane alone has 4 + 64 places.
    app = Lookup()
    middleware = share(app)
    burst = [asyncio.ensure_future(request(middleware)) for _ in range(200)]
    await asyncio.sleep(0.05)
    assert app.serving == 1  # the first request, looking the key up; the rest wait for it
    app.may_end.set()
    assert statuses(await asyncio.gather(*burst)) == {200: 200}
    assert (app.lookups, app.served) == (1, 200)
    # Once found, the key's requests are served in its tenant's lane (32 at once),
    # beside the first, which ends in the lane of unknown keys.
    assert 1 < app.most_serving <= 32 + 1


async def test_the_others_go_on_when_the_lookup_is_over_not_when_the_first_request_is() -> None:
    # The first request goes on for 2 s after its lookup (a long admission wait,
    # say): the key's other requests do not wait for that.
    app = Lookup(first_after_s=2.0)
    middleware = share(app)
    first = asyncio.ensure_future(request(middleware))
    await asyncio.sleep(0.01)
    others = [asyncio.ensure_future(request(middleware)) for _ in range(50)]
    await asyncio.sleep(0.01)
    app.may_end.set()
    async with asyncio.timeout(1.0):
        assert statuses(await asyncio.gather(*others)) == {200: 50}
    assert not first.done()
    first.cancel()


async def test_past_what_the_tenants_lane_would_take_a_keys_requests_are_refused_at_once() -> None:
    # 32 permits + 3 queued: the first request and 34 waiting for it; 5 refused.
    app = Lookup()
    middleware = share(app, max_waiting=3)
    burst = [asyncio.ensure_future(request(middleware)) for _ in range(40)]
    await asyncio.sleep(0.05)
    refused = [task.result() for task in burst if task.done()]
    assert len(refused) == 5
    for status, body in refused:
        error = body["error"]
        assert isinstance(error, dict)
        assert (status, error["limit"], error["scope"]) == (429, "concurrency", "unknown_keys")
        assert error["message"] == (
            "34 requests with this key are already waiting for its first lookup on this "
            "worker; retry shortly"
        )
    app.may_end.set()
    assert statuses(await asyncio.gather(*burst)) == {200: 35, 429: 5}


async def test_a_tenant_queue_of_zero_still_lets_a_burst_as_big_as_its_permits_through() -> None:
    app = Lookup()
    middleware = share(app, max_waiting=0)
    burst = [asyncio.ensure_future(request(middleware)) for _ in range(32)]
    await asyncio.sleep(0.01)
    app.may_end.set()
    assert statuses(await asyncio.gather(*burst)) == {200: 32}


async def test_with_the_store_away_the_waiting_requests_share_the_unknown_lane_as_before() -> None:
    # 600 requests with one key and a store that answers no lookup: after the
    # first's lookup fails, the others are triaged once more into the lane of
    # unknown keys itself (4 looking up at once, 64 queued, the rest 429); none
    # waits for another request's lookup a second time, none hangs.
    app = Lookup(store_answers=False, lookup_s=0.05)
    middleware = share(app, max_waiting=100_000)
    burst = [asyncio.ensure_future(request(middleware)) for _ in range(600)]
    await asyncio.sleep(0.05)
    app.may_end.set()
    async with asyncio.timeout(5.0):
        answers = statuses(await asyncio.gather(*burst))
    assert answers == {503: 1 + 4 + 64, 429: 600 - 1 - 4 - 64}, answers
    assert app.most_unknown_at_once <= 4
    assert middleware.waiting(UNKNOWN_KEYS_LANE) == 0


async def test_a_first_request_that_leaves_before_its_lookup_hands_its_place_on() -> None:
    # The first request is cancelled (its client went away) while it looks the
    # key up: the waiting ones are triaged again into the lane of unknown keys,
    # where one looks the key up for them all.
    app = Lookup()
    middleware = share(app)
    first = asyncio.ensure_future(request(middleware))
    await asyncio.sleep(0.01)
    rest = [asyncio.ensure_future(request(middleware)) for _ in range(10)]
    await asyncio.sleep(0.01)
    first.cancel()
    await asyncio.sleep(0.01)
    assert 1 <= app.serving <= 4  # looking the key up, in the lane of unknown keys
    app.may_end.set()
    assert statuses(await asyncio.gather(*rest)) == {200: 10}


async def test_all_keys_together_wait_no_more_than_the_lanes_of_keys_looked_up_at_once() -> None:
    # A flood of wrong keys, each with many requests, may not park more requests
    # than the tenant lanes of the keys looked up at once would take: here 1 key
    # at a time, a lane of 2 + 1, so 3 in all (and 2 per key).
    never = asyncio.Event()

    def triage(scope: Scope) -> Triage:
        return Triage(lane=UNKNOWN_KEYS_LANE, key=scope["key"])

    async def looks_up_for_ever(scope: Scope, receive: Receive, send: Send) -> None:
        await never.wait()

    middleware = TenantFairShare(
        looks_up_for_ever,
        triage=triage,
        max_in_progress=2,
        max_waiting=1,
        unknown_max_in_progress=1,
        unknown_max_waiting=3,
    )
    refusals: list[str] = []

    async def send(message: Message) -> None:
        if message["type"] == "http.response.body":
            refusals.append(json.loads(message["body"])["error"]["message"])

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    def arrive(key: bytes) -> asyncio.Future[None]:
        scope: Scope = {"type": "http", "path": "/v1/admit", "headers": [], "key": key}
        return asyncio.ensure_future(middleware(scope, receive, send))

    parked = [arrive(key) for key in (b"a", b"b", b"c", b"d")]  # 1 looking up, 3 queued
    parked += [arrive(b"a"), arrive(b"a")]  # the per-key bound: 2
    await asyncio.sleep(0.01)
    arrive(b"a")
    parked.append(arrive(b"b"))  # 3 in all
    await asyncio.sleep(0.01)
    arrive(b"b")
    arrive(b"e")  # a fifth key: the lane of unknown keys is full
    await asyncio.sleep(0.01)
    assert refusals == [
        "2 requests with this key are already waiting for its first lookup on this worker; "
        "retry shortly",
        "3 requests with keys this worker has not seen yet are already waiting for their "
        "lookups; retry shortly",
        "3 requests with keys this worker has not seen yet are already queued; retry shortly",
    ]
    assert not any(task.done() for task in parked)
    for task in parked:
        task.cancel()
    await asyncio.gather(*parked, return_exceptions=True)
