"""The edge of the service, over real sockets to a real uvicorn server.

Request heads and bodies that never finish are cut off in time; heads too big
or not HTTP get the one error shape; a 503 during an outage and a 500 tell
the client nothing of the inside but a request id that the log has with the
detail; /metrics answers only to its token when one is set. The protocol
tests run on both parsers `llmquota serve` may pick (h11, httptools), and one
test runs `llmquota serve` itself to prove it uses them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from llmquota.api.app import create_app
from llmquota.api.protocols import H11EdgeProtocol, http_protocol_class
from llmquota.api.protocols.httptools_edge import HttpToolsEdgeProtocol
from tests.faults.conftest import count, elapsed_since, fault_settings, worker_env
from tests.faults.proxy import PgProxy
from tests.ports import reserved_port

ADMIN_KEY = "lq_edge_admin_key_0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
METRICS_TOKEN = "lq_edge_metrics_token_0123456789"
TIMEOUT_SECONDS = 0.5
# An answer due at the timeout may come this much later on a busy shared machine.
SLACK_SECONDS = 1.0
HEAD_LIMIT = 65_536
PROTOCOLS = [
    pytest.param(H11EdgeProtocol, id="h11"),
    pytest.param(HttpToolsEdgeProtocol, id="httptools"),
]
REQUEST_ID = re.compile(r"req_[0-9a-f]{24}")


@contextlib.asynccontextmanager
async def serving(
    dsn: str, protocol: type[asyncio.Protocol] | None = None, **overrides: Any
) -> AsyncIterator[tuple[int, FastAPI]]:
    """The app on a real uvicorn server on a free port, with the protocol `serve` uses."""
    settings = fault_settings(admin_key=ADMIN_KEY, **{"decision_deadline_ms": 30_000, **overrides})
    app = create_app(settings, dsn=dsn)
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=0,
        log_level="warning",
        log_config=None,
        lifespan="on",
        http=protocol or http_protocol_class(),
    )
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        assert not task.done(), "uvicorn did not start"
        await asyncio.sleep(0.02)
    try:
        yield server.servers[0].sockets[0].getsockname()[1], app
    finally:
        server.should_exit = True
        await task


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 answer off the socket: status, headers (lower-case names), body."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    status_line, *lines = head.decode("latin-1").rstrip("\r\n").split("\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), 10)
    return int(status_line.split(" ", 2)[1]), headers, body


async def closed_by_server(reader: asyncio.StreamReader) -> bool:
    """Whether the server closes the connection, with nothing more to say, within 5 s.

    A reset counts as closed: a server closing a socket that still holds
    bytes the client sent makes the kernel answer the client's next ones
    with RST instead of FIN.
    """
    try:
        return await asyncio.wait_for(reader.read(), 5) == b""
    except ConnectionResetError:
        return True


def assert_error_shape(
    headers: dict[str, str], body: bytes, error_type: str, message: str | None = None
) -> dict[str, Any]:
    """The one error shape, with a request id that is also the x-request-id header."""
    assert headers["content-type"] == "application/json"
    document: dict[str, Any] = json.loads(body)
    assert set(document) == {"type", "error", "request_id"}
    assert document["type"] == "error"
    assert document["error"]["type"] == error_type
    if message is not None:
        assert document["error"] == {"type": error_type, "message": message}
    assert document["request_id"] == headers["x-request-id"]
    assert REQUEST_ID.fullmatch(document["request_id"])
    return document


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_body_declared_and_never_sent_gets_408_in_time_and_the_connection_closes(
    database_dsn: str, db: asyncpg.Connection, protocol: type[asyncio.Protocol]
) -> None:
    server = serving(database_dsn, protocol, body_read_timeout_seconds=TIMEOUT_SECONDS)
    async with server as (port, _app):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /v1/admit HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            + f"Authorization: Bearer {ADMIN_KEY}\r\ncontent-length: 200\r\n\r\n".encode()
            + b'{"tenant": "acme", '
        )
        await writer.drain()
        started = time.perf_counter()
        status, headers, body = await read_response(reader)
        took = elapsed_since(started)
        assert status == 408
        assert_error_shape(
            headers, body, "request_timeout", "the request body was not received within 0.5 s"
        )
        assert headers["connection"] == "close"
        assert await closed_by_server(reader)
        writer.close()
    assert TIMEOUT_SECONDS - 0.05 <= took < TIMEOUT_SECONDS + SLACK_SECONDS
    print(f"FIGURE edge body timeout 0.5 s ({protocol.__name__}): 408 after {took:.3f}s")
    assert await count(db, "reservations") == 0


async def test_a_trickled_body_gets_408_at_the_deadline_not_per_read(
    database_dsn: str, db: asyncpg.Connection
) -> None:
    server = serving(database_dsn, body_read_timeout_seconds=TIMEOUT_SECONDS)
    async with server as (port, _app):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /v1/admit HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            + f"Authorization: Bearer {ADMIN_KEY}\r\ncontent-length: 100\r\n\r\n".encode()
        )
        started = time.perf_counter()
        answer = asyncio.ensure_future(read_response(reader))
        sent = 0
        # A byte every 50 ms: each read is quick, the whole body would take 5 s.
        while not answer.done() and sent < 100:
            with contextlib.suppress(ConnectionError):
                writer.write(b" ")
                await writer.drain()
            sent += 1
            await asyncio.sleep(0.05)
        status, headers, body = await answer
        took = elapsed_since(started)
        writer.close()
    assert status == 408
    assert_error_shape(headers, body, "request_timeout")
    assert TIMEOUT_SECONDS - 0.05 <= took < TIMEOUT_SECONDS + SLACK_SECONDS
    assert sent < 40
    assert await count(db, "reservations") == 0


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_client_still_sending_a_refused_body_reads_the_413_not_a_reset(
    database_dsn: str, protocol: type[asyncio.Protocol]
) -> None:
    """The server answers before the body is read, then closes lingering.

    Closing a socket whose client keeps sending makes the kernel reset the
    connection and drop the answer not yet read: the client would see
    "connection reset by peer" instead of the 413 that says why.
    """
    declared = 4_000_000
    async with serving(database_dsn, protocol, max_body_bytes=1_024) as (port, _app):
        for _attempt in range(5):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            head = f"Authorization: Bearer {ADMIN_KEY}\r\ncontent-length: {declared}\r\n\r\n"
            writer.write(
                b"POST /v1/admit HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                + head.encode()
            )

            async def send_body(writer: asyncio.StreamWriter = writer) -> int:
                sent = 0
                with contextlib.suppress(ConnectionError):
                    while sent < declared:
                        writer.write(b" " * 65_536)
                        await writer.drain()
                        sent += 65_536
                return sent

            sending = asyncio.ensure_future(send_body())
            status, headers, body = await read_response(reader)
            assert status == 413
            assert_error_shape(headers, body, "payload_too_large")
            assert headers["connection"] == "close"
            assert await closed_by_server(reader)
            sending.cancel()
            writer.close()


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_head_that_never_completes_is_cut_off_in_time(
    database_dsn: str, protocol: type[asyncio.Protocol]
) -> None:
    server = serving(database_dsn, protocol, header_read_timeout_seconds=TIMEOUT_SECONDS)
    async with server as (port, _app):
        # Slowloris: a header line a byte at a time, never the blank line.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        started = time.perf_counter()
        answer = asyncio.ensure_future(read_response(reader))
        while not answer.done() and elapsed_since(started) < 5:
            with contextlib.suppress(ConnectionError):
                writer.write(b"a")
                await writer.drain()
            await asyncio.sleep(0.05)
        status, headers, body = await answer
        took = elapsed_since(started)
        assert status == 408
        assert_error_shape(
            headers, body, "request_timeout", "the request head was not received within 0.5 s"
        )
        assert await closed_by_server(reader)
        writer.close()

        # A connection that never says anything is closed quietly in the same time.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        started = time.perf_counter()
        assert await closed_by_server(reader)
        idle_took = elapsed_since(started)
        writer.close()

        # A healthy request on a keep-alive connection is not disturbed.
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            assert (await client.get("/healthz")).status_code == 200
            await asyncio.sleep(TIMEOUT_SECONDS + 0.2)
            assert (await client.get("/healthz")).status_code == 200
    for seconds in (took, idle_took):
        assert TIMEOUT_SECONDS - 0.05 <= seconds < TIMEOUT_SECONDS + SLACK_SECONDS
    print(
        f"FIGURE edge head timeout 0.5 s ({protocol.__name__}): 408 after {took:.3f}s, "
        f"idle connection closed after {idle_took:.3f}s"
    )


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_70kb_head_gets_a_json_400(
    database_dsn: str, protocol: type[asyncio.Protocol]
) -> None:
    big = b"X-Big: " + b"a" * 70_000 + b"\r\n"
    head = b"GET /healthz HTTP/1.1\r\nHost: x\r\n"
    expected = f"the request head exceeds {HEAD_LIMIT} bytes"
    async with serving(database_dsn, protocol) as (port, _app):
        # Whole, in one write: refused by whichever layer sees it first.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head + big + b"\r\n")
        status, headers, body = await read_response(reader)
        assert (status, json.loads(body)["error"]) == (
            400,
            {"type": "invalid_request_error", "message": expected},
        )
        assert_error_shape(headers, body, "invalid_request_error", expected)
        assert await closed_by_server(reader)
        writer.close()

        # Never finished: the server refuses it once past the limit, unread further.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for start in range(0, len(head + big), 8_192):
            with contextlib.suppress(ConnectionError):
                writer.write((head + big)[start : start + 8_192])
                await writer.drain()
            await asyncio.sleep(0.005)
        status, headers, body = await read_response(reader)
        assert status == 400
        assert_error_shape(headers, body, "invalid_request_error", expected)
        assert await closed_by_server(reader)
        writer.close()

        # Just under the limit, arriving in pieces, is an ordinary request.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        fits = head + b"X-Big: " + b"a" * 60_000 + b"\r\n\r\n"
        for start in range(0, len(fits), 8_192):
            writer.write(fits[start : start + 8_192])
            await writer.drain()
            await asyncio.sleep(0.005)
        status, headers, body = await read_response(reader)
        writer.close()
        assert (status, json.loads(body)) == (200, {"status": "ok"})


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_request_that_is_not_http_gets_a_json_400(
    database_dsn: str, protocol: type[asyncio.Protocol]
) -> None:
    async with serving(database_dsn, protocol) as (port, _app):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n")
        status, headers, body = await read_response(reader)
        assert status == 400
        assert_error_shape(
            headers, body, "invalid_request_error", "the request is not valid HTTP/1.1"
        )
        assert await closed_by_server(reader)
        writer.close()


SENTENCES = {
    "hang": "the limiter's database did not answer in time; retry",
    "refused": "the limiter's database is unavailable; retry",
}


async def test_a_503_in_an_outage_tells_no_internals_and_the_log_has_them_by_request_id(
    proxy: PgProxy, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="llmquota")
    body = {"tenant": "acme", "model": "gpt-4o", "input_tokens": 5, "max_tokens": 5}
    async with (
        serving(proxy.dsn, decision_deadline_ms=250) as (port, app),
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client,
    ):
        policy = {"tokens_per_minute": 60_000, "failure_mode": "closed"}
        put = await client.put("/v1/tenants/acme/policy", json=policy, headers=ADMIN)
        assert put.status_code == 200
        await app.state.limiter.refresh_policies()
        answers = {}
        proxy.pause()  # a hang: the deadline answers
        answers["hang"] = await client.post("/v1/admit", json=body, headers=ADMIN)
        traced = await client.get("/healthz", headers={"x-request-id": "trace-42.edge:1"})
        await proxy.cut()  # refused: the driver has an error to tell
        answers["refused"] = await client.post("/v1/admit", json=body, headers=ADMIN)
        insane = await client.get("/healthz", headers={"x-request-id": "no spaces " + "x" * 80})
        await proxy.restore()

    logged = {r.getMessage(): r for r in caplog.records if r.name.startswith("llmquota")}
    for kind, response in answers.items():
        assert response.status_code == 503, kind
        assert response.headers["retry-after"] == "1"
        document = assert_error_shape({**response.headers}, response.content, "limiter_unavailable")
        assert document["error"]["message"] == SENTENCES[kind]
        request_id = document["request_id"]
        records = [m for m in logged if request_id in m]
        assert len(records) == 1, (kind, list(logged))
        assert logged[records[0]].levelno == logging.WARNING
        # Every exception class the log names for it, the body does not.
        named = set(re.findall(r"\b[A-Z]\w*(?:Error|Exception|Timeout|Unavailable)\b", records[0]))
        assert named, records[0]
        assert not any(name in response.text for name in named), (kind, response.text)
        for internal in ("Errno", "127.0.0.1", str(proxy.port), "asyncpg", " ms"):
            assert internal not in response.text.replace(request_id, ""), (kind, internal)
    assert "StoreTimeout" in next(m for m in logged if answers["hang"].json()["request_id"] in m)
    # An incoming id that is a sane token follows the request; any other is replaced.
    assert traced.headers["x-request-id"] == traced.json()["request_id"] == "trace-42.edge:1"
    assert REQUEST_ID.fullmatch(insane.headers["x-request-id"])
    print(f"FIGURE edge 503 bodies: {[r.json()['error']['message'] for r in answers.values()]}")


async def test_an_unhandled_exception_is_a_json_500_with_only_a_request_id(
    database_dsn: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO, logger="llmquota")

    async def broken() -> None:
        raise RuntimeError("secret internal detail /var/lib/x")

    async with (
        serving(database_dsn) as (port, app),
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client,
    ):
        monkeypatch.setattr(app.state.admin, "ping", broken)
        response = await client.get("/healthz")
    assert response.status_code == 500
    document = assert_error_shape({**response.headers}, response.content, "api_error")
    assert "secret" not in response.text and "RuntimeError" not in response.text
    (record,) = [r for r in caplog.records if document["request_id"] in r.getMessage()]
    assert record.levelno == logging.ERROR
    assert "RuntimeError: secret internal detail" in record.getMessage()


async def test_metrics_answers_only_to_its_token_when_one_is_set(database_dsn: str) -> None:
    async with (
        serving(database_dsn, metrics_token=METRICS_TOKEN) as (port, _app),
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client,
    ):
        refused = [
            await client.get("/metrics", headers=headers)
            for headers in (
                {},
                ADMIN,
                {"Authorization": f"Bearer {METRICS_TOKEN}x"},
                {"Authorization": f"Basic {METRICS_TOKEN}"},
            )
        ]
        allowed = await client.get("/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
    for response in refused:
        assert response.status_code == 401
        assert response.headers["www-authenticate"] == "Bearer"
        assert_error_shape(
            {**response.headers},
            response.content,
            "authentication_error",
            "missing or invalid metrics token",
        )
    assert allowed.status_code == 200
    assert "llmquota_" in allowed.text

    # Off by default: no token is asked for.
    async with (
        serving(database_dsn) as (port, _app),
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client,
    ):
        open_metrics = await client.get("/metrics")
    assert open_metrics.status_code == 200 and "llmquota_" in open_metrics.text


async def test_llmquota_serve_cuts_off_a_slow_head_and_shapes_its_400(
    database_dsn: str, tmp_path: Path
) -> None:
    # uvicorn's own choice of parser (httptools if installed), guarded.
    assert issubclass(http_protocol_class(), AutoHTTPProtocol)
    assert http_protocol_class() in (H11EdgeProtocol, HttpToolsEdgeProtocol)
    port = reserved_port()
    env = {k: v for k, v in worker_env().items() if not k.startswith("LLMQUOTA_")}
    env.update(
        LLMQUOTA_DATABASE_URL=database_dsn,
        LLMQUOTA_ADMIN_KEY=ADMIN_KEY,
        LLMQUOTA_HEADER_READ_TIMEOUT_SECONDS=str(TIMEOUT_SECONDS),
    )
    output = tmp_path / "serve.log"
    with output.open("w") as log_file:
        serve = await asyncio.create_subprocess_exec(
            sys.executable,
            *("-m", "llmquota.cli", "serve", "--port", str(port)),
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            deadline = time.monotonic() + 60
            while True:
                assert serve.returncode is None, output.read_text()
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get("/healthz", timeout=1)).status_code == 200:
                        break
                assert time.monotonic() < deadline, "serve did not become healthy"
                await asyncio.sleep(0.2)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: a")
        started = time.perf_counter()
        status, headers, body = await read_response(reader)
        took = elapsed_since(started)
        writer.close()
        assert status == 408
        assert_error_shape(headers, body, "request_timeout")
        assert took < TIMEOUT_SECONDS + SLACK_SECONDS

        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"BROKEN\r\n\r\n")
        status, headers, body = await read_response(reader)
        writer.close()
        assert status == 400
        assert_error_shape(headers, body, "invalid_request_error")
    finally:
        serve.terminate()
        await asyncio.wait_for(serve.wait(), 30)
    # uvicorn shuts down cleanly, then exits by the signal it was sent.
    assert "Application shutdown complete" in output.read_text()
