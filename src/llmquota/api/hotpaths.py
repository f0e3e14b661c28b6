"""The admission hot path without FastAPI's routing: POST /v1/admit and settle.

Every client calls these two around each provider request. Profiling a
server worker under load put a quarter of its CPU in FastAPI's route
matching, dependency solving and response-model handling, more than the
admission itself (BENCHMARKS.md). This innermost middleware answers them
with the routes' own code (routes/admission.py) and the app's own exception
handlers, for requests in the ordinary shape: a JSON body, by its content
type, that parses and that the route's model accepts, and a reservation id
in canonical form. Anything else (another content type, JSON that does not
parse, a body the model refuses, a client gone mid-body, a root path) goes
on to the FastAPI app with what was read of it replayed, so every answer to
a malformed request is the one FastAPI gives. The routes stay declared
there too, for the OpenAPI schema and for those requests.

Order is FastAPI's: the body is read and parsed, then the caller is
authenticated, then the route runs; a body the model refuses goes on before
any authentication, so FastAPI authenticates it once, as ever.
"""

from __future__ import annotations

import collections
import inspect
import json
import re
import uuid
from typing import TypeVar

from fastapi import FastAPI
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmquota.api.auth import Caller
from llmquota.api.routes.admission import JSON_MEDIA_TYPE, admit_answer, settle_answer
from llmquota.api.schemas import AdmitBody, SettleBody

ADMIT_PATH = "/v1/admit"
# Only the canonical form: any other spelling FastAPI's UUID parsing may take
# or refuse goes to FastAPI, which then decides.
_SETTLE_PATH = re.compile(
    r"/v1/reservations/([0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-"
    r"[0-9a-fA-F]{12})/settle"
)
JSON_CONTENT_TYPE = b"application/json"

Body = TypeVar("Body", bound=BaseModel)


class HotPaths:
    """ASGI middleware answering admit and settle in their ordinary shape."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope.get("root_path"):
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        if path == ADMIT_PATH:
            await self._answer(scope, receive, send, None)
            return
        settle = _SETTLE_PATH.fullmatch(path)
        if settle is None:
            await self.app(scope, receive, send)
            return
        await self._answer(scope, receive, send, uuid.UUID(settle[1]))

    async def _answer(
        self, scope: Scope, receive: Receive, send: Send, reservation_id: uuid.UUID | None
    ) -> None:
        """Admit (no reservation id) or settle; the app answers what this cannot."""
        app: FastAPI = scope["app"]
        read: list[Message] = []
        try:
            if reservation_id is None:
                admit_body = await _body(scope, receive, AdmitBody, read)
                if admit_body is None:
                    await self.app(scope, _replaying(read, receive), send)
                    return
                caller = await _caller(app, scope)
                response = await admit_answer(admit_body, caller, app.state.limiter, scope, receive)
            else:
                settle_body = await _body(scope, receive, SettleBody, read)
                if settle_body is None:
                    await self.app(scope, _replaying(read, receive), send)
                    return
                caller = await _caller(app, scope)
                settled = await settle_answer(
                    reservation_id, settle_body, caller, app.state.limiter
                )
                response = Response(settled.model_dump_json().encode(), media_type=JSON_MEDIA_TYPE)
        except Exception as exc:
            # What FastAPI's exception middleware does: the app's handler for
            # the exception's class, else on to the request-id middleware's 500.
            handled = await _handled(app, Request(scope, receive), exc)
            if handled is None:
                raise
            response = handled
        await response(scope, receive, send)


async def _body(
    scope: Scope, receive: Receive, model: type[Body], read: list[Message]
) -> Body | None:
    """The request's body as `model`, or None for FastAPI to answer.

    Every message taken from `receive` is kept in `read`, for the replay. A
    refusal of the body limits (an HTTPException from `receive`) propagates.
    """
    if not _is_json(scope):
        return None
    chunks: list[bytes] = []
    while True:
        message = await receive()
        read.append(message)
        if message["type"] != "http.request":
            return None  # the client left mid-body
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    try:
        # json.loads, then the model in Python mode: exactly what FastAPI does,
        # so a body is accepted here if and only if FastAPI would accept it.
        return model.model_validate(json.loads(b"".join(chunks)))
    except Exception:
        return None  # FastAPI says why, in its words


def _is_json(scope: Scope) -> bool:
    """Whether the content type is application/json (parameters aside)."""
    for name, value in scope["headers"]:
        if name == b"content-type":
            media_type: bytes = value.split(b";", 1)[0].strip().lower()
            return media_type == JSON_CONTENT_TYPE
    return False


async def _caller(app: FastAPI, scope: Scope) -> Caller:
    """The authenticated caller, as the routes' `get_caller` dependency finds it."""
    authorization = None
    for name, value in scope["headers"]:
        if name == b"authorization":
            authorization = value.decode("latin-1")
            break
    client = scope.get("client")
    caller: Caller = await app.state.authenticator.caller(
        authorization, client[0] if client else "", scope
    )
    return caller


def _replaying(read: list[Message], receive: Receive) -> Receive:
    """`receive` giving the messages already read first, for the app behind."""
    pending = collections.deque(read)

    async def replay() -> Message:
        if pending:
            return pending.popleft()
        return await receive()

    return replay


async def _handled(app: FastAPI, request: Request, exc: Exception) -> Response | None:
    """The answer of the app's handler for `exc`'s class or its nearest base; None
    without one."""
    for cls in type(exc).__mro__:
        handler = app.exception_handlers.get(cls)
        if handler is not None:
            answer = handler(request, exc)
            return await answer if inspect.isawaitable(answer) else answer
    return None
