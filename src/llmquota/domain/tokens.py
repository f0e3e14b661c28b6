"""Counting input tokens before a request leaves.

Pure code: no database. The rank files ship with the package and are checked
against the SHA-256 that tiktoken itself expects, so nothing downloads at run
time and a corrupted file fails loudly instead of miscounting.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import tiktoken
from tiktoken.model import encoding_name_for_model

from llmquota.domain.media import MEDIA_TYPES, media_tokens
from llmquota.resources import encodings_dir

# The SHA-256 of each rank file, as pinned by tiktoken_ext/openai_public.py.
_EXPECTED_SHA256 = {
    "cl100k_base": "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
    "o200k_base": "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
}

# Regexes and special tokens as in tiktoken_ext/openai_public.py.
_CL100K_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|"""
    r"""\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
_O200K_PATTERN = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
_SPECIAL_TOKENS = {
    "cl100k_base": {
        "<|endoftext|>": 100257,
        "<|fim_prefix|>": 100258,
        "<|fim_middle|>": 100259,
        "<|fim_suffix|>": 100260,
        "<|endofprompt|>": 100276,
    },
    "o200k_base": {"<|endoftext|>": 199999, "<|endofprompt|>": 200018},
}
_PATTERNS = {"cl100k_base": _CL100K_PATTERN, "o200k_base": _O200K_PATTERN}

# OpenAI's chat format: every message costs its content plus a fixed framing
# (<|start|>{role}\n ... <|end|>\n), a name field costs one more, and the reply
# is primed with three tokens. These are the figures OpenAI's cookbook uses for
# gpt-3.5-turbo-0613 and later, gpt-4 and the o200k models.
TOKENS_PER_MESSAGE = 3
TOKENS_PER_NAME = 1
TOKENS_REPLY_PRIMING = 3

DEFAULT_ESTIMATE_FACTOR = 1.25

# Text longer than this is encoded in pieces. tiktoken's pre-tokenizing regex
# backtracks, and on a long enough run (a million spaces) it gives up with
# "Max stack size exceeded"; pieces keep every call far below that. A piece
# ends, where it can, just before a space that follows a non-space, which is
# where the regex starts a new pre-token anyway, so the sum of the pieces is
# the count of the whole; where it cannot (a run longer than a piece) the cut
# may add a token or two, and the count is marked as an estimate.
PIECE_CHARS = 8_192
# No CPU limit unless the caller gives one.
UNLIMITED_SECONDS = math.inf


class TokenCountError(ValueError):
    """The messages cannot be counted: wrong shape or wrong types."""


@dataclass(slots=True)
class CpuBudget:
    """The CPU time one count may spend before it estimates what is left.

    Measured on the counting thread's own clock, so time the thread spends
    waiting for a core does not count against the request. Reading that
    clock is a system call, so an unlimited budget never reads it.
    """

    seconds: float = UNLIMITED_SECONDS
    clock: Callable[[], float] = time.thread_time
    started: float = field(init=False)

    def __post_init__(self) -> None:
        self.started = self.clock() if self.limited else 0.0

    @property
    def limited(self) -> bool:
        return self.seconds != UNLIMITED_SECONDS

    def exhausted(self) -> bool:
        """Whether the budget is spent."""
        return self.limited and self.clock() - self.started >= self.seconds


@dataclass(frozen=True, slots=True)
class TokenCount:
    """Input tokens for one request, and whether the figure is an estimate."""

    tokens: int
    encoding: str
    estimated: bool


@functools.cache
def get_encoding(name: str) -> tiktoken.Encoding:
    """Load one of the shipped encodings, verifying its hash; cached per process.

    The file is read and hashed here rather than through tiktoken's loader,
    which would copy it into a cache directory and trust that copy afterwards.
    """
    if name not in _EXPECTED_SHA256:
        raise KeyError(f"unknown encoding {name!r}")
    contents = (encodings_dir() / f"{name}.tiktoken").read_bytes()
    digest = hashlib.sha256(contents).hexdigest()
    if digest != _EXPECTED_SHA256[name]:
        raise ValueError(
            f"{name}.tiktoken has SHA-256 {digest}, expected {_EXPECTED_SHA256[name]}: "
            "the shipped rank file is corrupt"
        )
    ranks = {
        base64.b64decode(token): int(rank)
        for token, rank in (line.split() for line in contents.splitlines() if line)
    }
    return tiktoken.Encoding(
        name=name,
        pat_str=_PATTERNS[name],
        mergeable_ranks=ranks,
        special_tokens=_SPECIAL_TOKENS[name],
    )


def encoding_for_model(model: str) -> tuple[str, bool]:
    """The encoding used to count `model`, and whether the count is exact.

    tiktoken's own model table decides (fine-tunes and Azure names included)
    where it names an encoding we ship; anything else (claude-*, open models)
    is counted with o200k_base and scaled, so the figure is an estimate.
    """
    try:
        name = encoding_name_for_model(model.lower())
    except KeyError:
        return "o200k_base", False
    if name in _EXPECTED_SHA256:
        return name, True
    return "o200k_base", False


def _message_text(message: Mapping[str, Any]) -> list[str]:
    """The strings of one chat message that the model reads."""
    return _message_parts(message)[0]


def _inline_text(block: Mapping[str, Any]) -> str | None:
    """The text of a plain-text document block (Anthropic's source type text), else None."""
    source = block.get("source")
    if (
        block.get("type") == "document"
        and isinstance(source, Mapping)
        and source.get("type") == "text"
        and isinstance(source.get("data"), str)
    ):
        return str(source["data"])
    return None


def _message_parts(message: Mapping[str, Any]) -> tuple[list[str], list[Mapping[str, Any]]]:
    """The strings of one chat message that the model reads, and its media blocks."""
    if not isinstance(message, Mapping):
        raise TokenCountError("each message must be an object with 'role' and 'content'")
    parts: list[str] = []
    media: list[Mapping[str, Any]] = []
    for key in ("role", "name"):
        value = message.get(key)
        if value is not None:
            if not isinstance(value, str):
                raise TokenCountError(f"message {key} must be a string")
            parts.append(value)
    content = message.get("content")
    if content is None:
        return parts, media
    if isinstance(content, str):
        parts.append(content)
    elif isinstance(content, list):
        _content_blocks(content, parts, media)
    else:
        raise TokenCountError("message content must be a string or a list of blocks")
    return parts, media


def _content_blocks(content: list[Any], parts: list[str], media: list[Mapping[str, Any]]) -> None:
    """Sort content blocks: text is encoded, images, audio and documents priced (media.py)."""
    for block in content:
        if isinstance(block, Mapping) and isinstance(block.get("text"), str):
            parts.append(block["text"])
        elif isinstance(block, str):
            parts.append(block)
        elif isinstance(block, Mapping) and (text := _inline_text(block)) is not None:
            parts.append(text)
        elif isinstance(block, Mapping) and block.get("type") in MEDIA_TYPES:
            media.append(block)
        else:
            raise TokenCountError(
                "content blocks must be strings, objects with a 'text', or images, "
                "audio and documents"
            )


def count_text(
    text: str, model: str, estimate_factors: Mapping[str, float] | None = None
) -> TokenCount:
    """Tokens in plain text (no chat framing), as the CLI's `tokens` command counts stdin."""
    encoding_name, exact = encoding_for_model(model)
    raw, cut = encoded_length(get_encoding(encoding_name), text, CpuBudget())
    return _scaled(raw, model, encoding_name, exact and not cut, estimate_factors)


def count_messages(
    messages: Sequence[Mapping[str, Any]],
    model: str,
    estimate_factors: Mapping[str, float] | None = None,
    budget: CpuBudget | None = None,
) -> TokenCount:
    """Input tokens of a chat request, framing included.

    Past its CPU budget the count stops encoding and bounds what is left from
    above (see encoded_length): marked as an estimate, never an undercount.
    Images, audio and documents are priced in the provider's own tokens
    (media.py), added after the tokenizer's scaling, and mark the count as
    an estimate.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes):
        raise TokenCountError("messages must be a list of message objects")
    encoding_name, exact = encoding_for_model(model)
    encoding = get_encoding(encoding_name)
    budget = budget or CpuBudget()
    raw, priced = TOKENS_REPLY_PRIMING, 0
    for message in messages:
        raw += TOKENS_PER_MESSAGE
        if isinstance(message, Mapping) and message.get("name") is not None:
            raw += TOKENS_PER_NAME
        parts, media = _message_parts(message)
        for part in parts:
            tokens, estimated = encoded_length(encoding, part, budget)
            raw += tokens
            exact = exact and not estimated
        priced += sum(media_tokens(block, model) for block in media)
    counted = _scaled(raw, model, encoding_name, exact, estimate_factors)
    if not priced:
        return counted
    return TokenCount(tokens=counted.tokens + priced, encoding=encoding_name, estimated=True)


def message_chars(messages: Sequence[Mapping[str, Any]]) -> int:
    """How many characters of text the messages hold (what counting them costs)."""
    total = 0
    for message in messages:
        if isinstance(message, Mapping):
            total += sum(len(part) for part in _message_text(message))
    return total


def encoded_length(encoding: tiktoken.Encoding, text: str, budget: CpuBudget) -> tuple[int, bool]:
    """Tokens of `text`, and whether the figure is an estimate.

    Long text is encoded piece by piece (PIECE_CHARS). Once the budget is
    spent, what is left is not encoded but bounded: a byte-level BPE token
    holds at least one byte, so the UTF-8 length of the rest is never less
    than its token count. A caller flooding megabytes of text pays for it in
    its own reservation, not in everyone's CPU.
    """
    if len(text) <= PIECE_CHARS:
        # A short part is one piece, unless the parts before it spent the budget.
        if budget.exhausted():
            return len(text.encode("utf-8", "surrogatepass")), True
        return len(encoding.encode(text, disallowed_special=())), False
    tokens, estimated, position = 0, False, 0
    for end, clean in _piece_ends(text):
        if budget.exhausted():
            return tokens + len(text[position:].encode("utf-8", "surrogatepass")), True
        tokens += len(encoding.encode(text[position:end], disallowed_special=()))
        estimated = estimated or not clean
        position = end
    return tokens, estimated


def _piece_ends(text: str) -> Iterator[tuple[int, bool]]:
    """Where each piece of `text` ends, and whether it ends at a pre-token boundary."""
    start = 0
    while len(text) - start > PIECE_CHARS:
        limit = start + PIECE_CHARS
        cut = text.rfind(" ", start + PIECE_CHARS // 2, limit)
        if cut > start and not text[cut - 1].isspace():
            yield cut, True
        else:
            cut = limit
            yield cut, False
        start = cut
    yield len(text), True


def _scaled(
    raw: int,
    model: str,
    encoding_name: str,
    exact: bool,
    estimate_factors: Mapping[str, float] | None,
) -> TokenCount:
    if exact:
        return TokenCount(tokens=raw, encoding=encoding_name, estimated=False)
    factor = estimate_factor(model, estimate_factors)
    return TokenCount(tokens=math.ceil(raw * factor), encoding=encoding_name, estimated=True)


def estimate_factor(model: str, estimate_factors: Mapping[str, float] | None) -> float:
    """The configured factor for a model: exact name first, then the longest matching prefix."""
    factors = estimate_factors or {}
    if model in factors:
        return factors[model]
    best = ""
    for prefix in factors:
        if prefix.endswith("*") and model.startswith(prefix[:-1]) and len(prefix) > len(best):
            best = prefix
    return factors[best] if best else DEFAULT_ESTIMATE_FACTOR
