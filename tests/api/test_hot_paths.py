"""Admit and settle answer alike through the hot paths and through FastAPI's routes.

llmquota.api.hotpaths answers requests in the ordinary shape itself and
hands every other one to the FastAPI routes with its body replayed. Each
test sends one request the hot path takes and one it hands on, and checks
that the answers agree.
"""

from __future__ import annotations

import json

import httpx

from tests.api.conftest import make_tenant

MESSAGES = [{"role": "user", "content": "Summarise the attached contract."}]
# Taken by FastAPI as JSON; not by the hot path, which reads only application/json.
VENDOR_JSON = "application/vnd.llmquota+json"


def _admit_body(**fields: object) -> bytes:
    body: dict[str, object] = {"tenant": "acme", "model": "gpt-4o", "max_tokens": 100}
    body.update(fields)
    return json.dumps(body).encode()


async def test_an_admission_handed_on_answers_like_one_taken(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    acme = await make_tenant(client, admin, "acme", tokens_per_minute=60_000)
    answers = [
        await client.post(
            "/v1/admit",
            content=_admit_body(messages=MESSAGES),
            headers={**acme, "content-type": content_type},
        )
        for content_type in ("application/json; charset=utf-8", VENDOR_JSON)
    ]
    for response in answers:
        assert response.status_code == 201, response.text
        assert response.headers["content-type"] == "application/json"
        assert response.headers["x-request-id"].startswith("req_")
    taken, handed_on = (response.json() for response in answers)
    assert list(taken) == list(handed_on)  # the same fields, in the same order
    assert taken["input_tokens"] == handed_on["input_tokens"]
    assert taken["reservation_id"] != handed_on["reservation_id"]


async def test_a_refused_body_gets_fastapis_answer(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    acme = await make_tenant(client, admin, "acme", tokens_per_minute=60_000)
    response = await client.post(
        "/v1/admit",
        content=_admit_body(max_tokens=1.5),
        headers={**acme, "content-type": "application/json"},
    )
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith("max_tokens: ")
    # Not JSON at all: FastAPI's words for it.
    response = await client.post(
        "/v1/admit", content=b"{", headers={**acme, "content-type": "application/json"}
    )
    assert response.status_code == 422
    assert response.json()["error"]["message"].startswith("body is not valid JSON")


async def test_errors_of_the_route_are_rendered_by_the_apps_handlers(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    acme = await make_tenant(client, admin, "acme", tokens_per_minute=60_000)
    await make_tenant(client, admin, "globex", tokens_per_minute=60_000)
    forbidden = await client.post(
        "/v1/admit",
        content=_admit_body(tenant="globex"),
        headers={**acme, "content-type": "application/json"},
    )
    assert forbidden.status_code == 403
    assert forbidden.json()["error"]["type"] == "permission_error"
    unauthenticated = await client.post(
        "/v1/admit", content=_admit_body(), headers={"content-type": "application/json"}
    )
    assert unauthenticated.status_code == 401
    assert unauthenticated.headers["www-authenticate"] == "Bearer"


async def test_a_settlement_answers_alike_by_either_path(
    client: httpx.AsyncClient, admin: dict[str, str]
) -> None:
    acme = await make_tenant(client, admin, "acme", tokens_per_minute=60_000)
    settled = []
    for spelling in (str, lambda rid: rid.replace("-", "")):  # canonical, then handed on
        admitted = await client.post(
            "/v1/admit",
            content=_admit_body(messages=MESSAGES),
            headers={**acme, "content-type": "application/json"},
        )
        assert admitted.status_code == 201, admitted.text
        reservation_id = spelling(admitted.json()["reservation_id"])
        response = await client.post(
            f"/v1/reservations/{reservation_id}/settle",
            json={"input_tokens": 10, "output_tokens": 20},
            headers=acme,
        )
        assert response.status_code == 200, response.text
        settled.append(response.content)
    assert settled[0] == settled[1]
    missing = await client.post(
        "/v1/reservations/00000000-0000-0000-0000-000000000000/settle",
        json={"input_tokens": 1, "output_tokens": 1},
        headers=acme,
    )
    assert missing.status_code == 404
    assert missing.json()["error"]["type"] == "not_found_error"
