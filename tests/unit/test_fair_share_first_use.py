"""The lane of unknown keys takes one place per key: a key's first request
looks it up, and the key's other requests wait for that one, then are
triaged again (api/fairness.py).

Driven through the middleware's ASGI interface with a triage and an app of
the test's own, so that the moment the lookup ends is the test's to choose.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter

from starlette.types import Message, Receive, Scope, Send

from llmquota.api.auth import UNKNOWN_KEYS_LANE, Triage
from llmquota.api.fairness import TenantFairShare

KEY = b"digest of a key the worker has not seen"


class Lookup:
    """An app whose first request 'looks the key up' until the test lets it end."""

    def __init__(self) -> None:
        self.found = False
        self.may_end = asyncio.Event()
        self.served = 0
        self.serving = 0
        self.most_serving = 0

    def triage(self, scope: Scope) -> Triage:
        if self.found:
            return Triage(lane="acme")
        return Triage(lane=UNKNOWN_KEYS_LANE, key=KEY)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.serving += 1
        self.most_serving = max(self.most_serving, self.serving)
        try:
            if not self.found:
                await self.may_end.wait()
                self.found = True
            else:
                await asyncio.sleep(0.001)  # an admission's own await
            self.served += 1
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})
        finally:
            self.serving -= 1


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


async def test_a_keys_first_burst_waits_for_one_lookup_and_is_served_whole() -> None:
    # 200 requests with one new key: the unknown lane alone has 4 + 64 places.
    app = Lookup()
    middleware = share(app)
    burst = [asyncio.ensure_future(request(middleware)) for _ in range(200)]
    await asyncio.sleep(0.05)
    assert app.serving == 1  # the first request, looking the key up; the rest wait for it
    app.may_end.set()
    statuses = Counter([status for status, _ in await asyncio.gather(*burst)])
    assert statuses == {200: 200}
    assert app.served == 200
    # Once found, the key's requests are served in its tenant's lane (32 at once).
    assert 1 < app.most_serving <= 32


async def test_past_max_waiting_the_keys_further_requests_are_refused_at_once() -> None:
    app = Lookup()
    middleware = share(app, max_waiting=3)
    burst = [asyncio.ensure_future(request(middleware)) for _ in range(6)]
    await asyncio.sleep(0.05)
    refused = [task.result() for task in burst if task.done()]
    assert len(refused) == 2
    for status, body in refused:
        error = body["error"]
        assert isinstance(error, dict)
        assert (status, error["limit"], error["scope"]) == (429, "concurrency", "unknown_keys")
    app.may_end.set()
    statuses = Counter([status for status, _ in await asyncio.gather(*burst)])
    assert statuses == {200: 4, 429: 2}


async def test_a_first_request_that_never_reaches_the_lookup_hands_its_place_on() -> None:
    # The first request is cancelled (its client went away) while it looks the
    # key up: one of the waiting requests becomes the first, and all are served.
    app = Lookup()
    middleware = share(app)
    first = asyncio.ensure_future(request(middleware))
    await asyncio.sleep(0.01)
    rest = [asyncio.ensure_future(request(middleware)) for _ in range(10)]
    await asyncio.sleep(0.01)
    first.cancel()
    await asyncio.sleep(0.01)
    assert app.serving == 1  # another one now looks the key up
    app.may_end.set()
    assert Counter([status for status, _ in await asyncio.gather(*rest)]) == {200: 10}
