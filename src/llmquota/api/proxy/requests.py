"""Reading a proxied request: what to count, what to reserve, whether it streams.

Everything a refusal depends on is checked here, before a reservation is
made or a byte goes upstream: a request the provider would refuse for its
shape costs the tenant nothing. The messages are turned into the form
/v1/admit counts (role, name, text), so the proxy counts input exactly as
admission does: text blocks as text; tool calls and tool definitions as
their JSON; tool results as their text and media; images, audio and
documents priced as the provider prices them (llmquota.domain.media, an
estimate, so the reservation is marked `input_estimated`). Legacy
completions and embeddings count their prompt or input texts the same way,
and token-id inputs one token each.

A bad parameter is a 400 naming it, as the providers answer it (a model
name outside the pattern of llmquota.domain.names among them); a model no
output bound is known for, asked without max_tokens, is refused rather than
forwarded with a guessed reservation.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from llmquota.api.proxy.wire import Endpoint, Kind, kind_of
from llmquota.domain.json_limits import loads_bounded
from llmquota.domain.media import MEDIA_TYPES
from llmquota.domain.model_limits import max_output_tokens
from llmquota.domain.names import MODEL_RULE, is_model

MAX_CHOICES = 128
# OpenAI's own default for the legacy completions endpoint: what it generates
# when max_tokens is absent, so what the proxy reserves.
LEGACY_DEFAULT_MAX_TOKENS = 16


class BadProxyRequest(Exception):
    """A request answered with a provider-format error before anything is reserved."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param  # the request field at fault, as OpenAI's errors name it


@dataclass(frozen=True, slots=True)
class ProxyRequest:
    """A parsed request: the body to send, and what admission needs from it."""

    body: dict[str, Any]
    model: str
    # What admission counts: chat-shaped messages, or a count of token ids.
    messages: list[dict[str, Any]] | None
    input_tokens: int | None
    max_tokens: int
    stream: bool
    # OpenAI streams: whether the client asked for the usage chunk itself.
    client_wants_usage: bool
    # False: the body gave no output limit; max_tokens is a default, and
    # admission reserves the learned estimate where it has one.
    max_tokens_given: bool = True


def parse(
    endpoint: Endpoint,
    raw: bytes,
    default_max_tokens: int | None,
    unserved: Callable[[str], str | None] = lambda _model: None,
) -> ProxyRequest:
    """Validate a request body; raises BadProxyRequest (400, or 404 for a model
    `unserved` explains no upstream serves, checked before anything else about it)."""
    kind = kind_of(endpoint)
    try:
        body = loads_bounded(raw)
    except ValueError as exc:  # UnicodeDecodeError and JsonTooDeep are ValueErrors
        raise BadProxyRequest(400, f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadProxyRequest(400, "the body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadProxyRequest(400, "'model' is required and must be a string", "model")
    if not is_model(model):
        # Before the upstream lookup: a name no upstream could serve is the
        # client's mistake (400), not a model missing here (404).
        raise BadProxyRequest(400, f"'model' must be {MODEL_RULE}", "model")
    if (why := unserved(model)) is not None:
        raise BadProxyRequest(404, why, "model")
    stream = body.get("stream", False)
    if not isinstance(stream, bool) or (stream and endpoint in ("embeddings", "count_tokens")):
        message = "'stream' must be a boolean (and false for embeddings and token counts)"
        raise BadProxyRequest(400, message, "stream")
    given = True
    if endpoint in ("embeddings", "count_tokens"):
        output = 0  # a count generates nothing
    elif endpoint == "completions":
        output = _positive(body, "max_tokens") or default_max_tokens or LEGACY_DEFAULT_MAX_TOKENS
        output *= max(_choices(kind, body), _positive(body, "best_of") or 1)
    else:
        output, given = _output_tokens(kind, body, model, default_max_tokens)
        output *= _choices(kind, body)
    options = body.get("stream_options")
    wants_usage = isinstance(options, Mapping) and options.get("include_usage") is True
    messages, input_tokens = _input(endpoint, body)
    return ProxyRequest(
        body=body,
        model=model,
        messages=messages,
        input_tokens=input_tokens,
        max_tokens=output,
        stream=stream,
        client_wants_usage=wants_usage,
        max_tokens_given=given,
    )


def _input(
    endpoint: Endpoint, body: Mapping[str, Any]
) -> tuple[list[dict[str, Any]] | None, int | None]:
    """(messages to count, or a count of token ids) of a request."""
    if endpoint in ("chat", "messages", "count_tokens"):
        return _countable(kind_of(endpoint), body), None
    field = "input" if endpoint == "embeddings" else "prompt"
    value = body.get(field)
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise BadProxyRequest(400, f"'{field}' is required: a string or a list", field)
    if all(isinstance(v, str) for v in value):
        return [{"role": "user", "content": value}], None
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return None, len(value)  # token ids: each one is a token
    if all(isinstance(v, list) and all(isinstance(t, int) for t in v) for v in value):
        return None, sum(len(v) for v in value)
    message = f"'{field}' must be text, a list of texts or of token ids"
    raise BadProxyRequest(400, message, field)


def _positive(body: Mapping[str, Any], field: str) -> int | None:
    value = body.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadProxyRequest(400, f"'{field}' must be a positive integer", field)
    return value


def _choices(kind: Kind, body: Mapping[str, Any]) -> int:
    """How many completions one request asks for (OpenAI's `n`)."""
    if kind != "openai":
        return 1
    n = _positive(body, "n") or 1
    if n > MAX_CHOICES:
        raise BadProxyRequest(400, f"'n' must be at most {MAX_CHOICES}", "n")
    return n


def _output_tokens(
    kind: Kind, body: Mapping[str, Any], model: str, default_max_tokens: int | None
) -> tuple[int, bool]:
    """The output limit of one completion: asked for, else the configured default,
    else the model's maximum output; and whether the body asked for it."""
    fields = ("max_completion_tokens", "max_tokens") if kind == "openai" else ("max_tokens",)
    for field in fields:
        asked = _positive(body, field)
        if asked is not None:
            return asked, True
    if default_max_tokens is not None:
        return default_max_tokens, False
    ceiling = max_output_tokens(model)
    if ceiling is None:
        raise BadProxyRequest(
            400,
            f"model {model!r} has no known maximum output, so llmquota cannot bound what "
            f"to reserve for it: give {fields[0]}, or the operator sets "
            "LLMQUOTA_PROXY_DEFAULT_MAX_TOKENS",
            fields[0],
        )
    return ceiling, False


def _text(value: object) -> str:
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


def _blocks(content: object) -> list[str | Mapping[str, Any]]:
    """The countable parts of a message's content: text, and media blocks as they are."""
    if content is None:
        return []
    if not isinstance(content, list):
        return [_text(content)]
    parts: list[str | Mapping[str, Any]] = []
    for block in content:
        if isinstance(block, Mapping) and block.get("type") in MEDIA_TYPES:
            parts.append(block)
        elif isinstance(block, Mapping) and isinstance(block.get("text"), str):
            parts.append(block["text"])
        elif isinstance(block, Mapping) and block.get("type") == "tool_result":
            # Its own content may hold images (a screenshot tool): priced, not encoded as JSON.
            rest = {k: v for k, v in block.items() if k != "content"}
            parts.append(_text(rest))
            parts.extend(_blocks(block.get("content")))
        else:
            parts.append(_text(block))
    return parts


def _countable(kind: Kind, body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The messages (system prompt and tools included) in the form admission counts."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise BadProxyRequest(400, "'messages' is required and must be a list", "messages")
    counted: list[dict[str, Any]] = []
    if kind == "anthropic" and body.get("system") is not None:
        counted.append({"role": "system", "content": _blocks(body["system"])})
    if body.get("tools") is not None:
        counted.append({"role": "system", "content": [_text(body["tools"])]})
    for message in messages:
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            message_error = "each message must be an object with a string 'role'"
            raise BadProxyRequest(400, message_error, "messages")
        parts = _blocks(message.get("content"))
        if message.get("tool_calls") is not None:
            parts.append(_text(message["tool_calls"]))
        entry: dict[str, Any] = {"role": message["role"], "content": parts}
        if isinstance(message.get("name"), str):
            entry["name"] = message["name"]
        counted.append(entry)
    return counted
