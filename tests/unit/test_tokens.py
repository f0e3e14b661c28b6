"""Token counting: the shipped rank files, model -> encoding, chat framing.

Known answers come from tiktoken's own tests (openai/tiktoken tests/test_encoding.py:
test_simple, test_simple_regex, test_basic_encode, test_encode_surrogate_pairs,
test_encode_bytes) and, for o200k_base, from the widely reproduced
"hello world" -> [24912, 2375].
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tiktoken
import tiktoken.model
import tiktoken_ext.openai_public
from pydantic import ValidationError
from tiktoken.load import load_tiktoken_bpe

from llmquota.config import Settings
from llmquota.domain import tokens
from llmquota.domain.tokens import (
    DEFAULT_ESTIMATE_FACTOR,
    TokenCountError,
    count_messages,
    count_text,
    encoding_for_model,
    estimate_factor,
    get_encoding,
)
from llmquota.resources import encodings_dir

CL100K_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"


@pytest.fixture
def cl100k() -> tiktoken.Encoding:
    return get_encoding("cl100k_base")


@pytest.fixture
def o200k() -> tiktoken.Encoding:
    return get_encoding("o200k_base")


# --- the shipped encodings give tiktoken's published ids --------------------


@pytest.mark.parametrize(
    ("text", "ids"),
    [
        ("hello world", [15339, 1917]),
        ("rer", [38149]),
        ("'rer", [2351, 81]),
        ("today\n ", [31213, 198, 220]),
        ("today\n \n", [31213, 27907]),
        ("today\n  \n", [31213, 14211]),
        (" \x850", [220, 126, 227, 15]),
        ("👍", [9468, 239, 235]),
        ("", []),
    ],
)
def test_cl100k_encodes_tiktoken_published_ids(
    cl100k: tiktoken.Encoding, text: str, ids: list[int]
) -> None:
    assert cl100k.encode(text) == ids
    assert cl100k.decode(ids) == text


def test_cl100k_encodes_bytes_and_special_tokens_as_tiktoken_does(
    cl100k: tiktoken.Encoding,
) -> None:
    assert cl100k._encode_bytes(b" \xec\x8b\xa4\xed") == [62085]
    assert cl100k.encode("hello <|endoftext|>", allowed_special="all") == [15339, 220, 100257]
    # Counted as ordinary text (what count_messages does): seven pieces, no 100257.
    assert cl100k.encode("<|endoftext|>", disallowed_special=()) == [27, 91, 8862, 728, 428, 91, 29]
    assert cl100k.n_vocab == 100_277
    assert cl100k.eot_token == 100_257


def test_o200k_encodes_tiktoken_published_ids(o200k: tiktoken.Encoding) -> None:
    assert o200k.encode("hello world") == [24912, 2375]
    assert o200k.decode([24912, 2375]) == "hello world"
    assert o200k.encode("hello <|endoftext|>", allowed_special="all") == [24912, 220, 199999]
    assert o200k.n_vocab == 200_019
    assert o200k.eot_token == 199_999


@pytest.mark.parametrize("name", ["cl100k_base", "o200k_base"])
@pytest.mark.parametrize(
    "text", ["hello", " hello  ", "请考试我的软件\uff0112345", "x" * 10_000, "\n\n\t  ok"]
)
def test_shipped_encodings_round_trip_text(name: str, text: str) -> None:
    encoding = get_encoding(name)
    assert encoding.decode(encoding.encode(text)) == text


@pytest.mark.parametrize("name", ["cl100k_base", "o200k_base"])
def test_shipped_encoding_parameters_equal_tiktoken_constructors(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Our regex and special tokens are exactly those of tiktoken_ext.openai_public.

    Its constructors download the rank file; swap the loader for one that
    records the expected hash and returns our verified ranks.
    """
    ours = get_encoding(name)
    seen: dict[str, Any] = {}

    def fake_load(url: str, expected_hash: str | None = None) -> dict[bytes, int]:
        seen["hash"] = expected_hash
        return ours._mergeable_ranks  # type: ignore[no-any-return]

    monkeypatch.setattr(tiktoken_ext.openai_public, "load_tiktoken_bpe", fake_load)
    constructor = getattr(tiktoken_ext.openai_public, name)
    theirs = tiktoken.Encoding(**constructor())
    assert ours._pat_str == theirs._pat_str
    assert ours._special_tokens == theirs._special_tokens
    assert seen["hash"] == {"cl100k_base": CL100K_SHA256, "o200k_base": O200K_SHA256}[name]
    sample = "Don't  panic: 1234567 ünïcödé\r\n\tIT'S <|endoftext|> fine.  "
    assert ours.encode(sample, disallowed_special=()) == theirs.encode(
        sample, disallowed_special=()
    )


def test_sha256sums_file_matches_the_pinned_hashes() -> None:
    lines = (encodings_dir() / "SHA256SUMS").read_text().split("\n")
    pinned = dict(reversed(line.split()) for line in lines if line.strip())
    assert pinned == {
        "cl100k_base.tiktoken": CL100K_SHA256,
        "o200k_base.tiktoken": O200K_SHA256,
    }


def test_unknown_encoding_name_is_refused() -> None:
    with pytest.raises(KeyError):
        get_encoding("p50k_base")


# --- corrupted rank files fail the hash check --------------------------------


@pytest.fixture
def fresh_encoding_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty tiktoken cache and an empty get_encoding cache, restored after."""
    cache = tmp_path / "tiktoken-cache"
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    get_encoding.cache_clear()
    yield cache
    get_encoding.cache_clear()


def _corrupt_copy(source: Path, target: Path) -> None:
    shutil.copyfile(source, target)
    data = bytearray(target.read_bytes())
    # Flip one digit of the first rank: still parseable, silently wrong ids.
    line_end = data.index(b"\n")
    data[line_end - 1] = ord("7") if data[line_end - 1] != ord("7") else ord("8")
    target.write_bytes(bytes(data))


@pytest.mark.parametrize("name", ["cl100k_base", "o200k_base"])
def test_corrupted_rank_file_fails_the_hash_check(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_encoding_cache: Path
) -> None:
    encodings = tmp_path / "encodings"
    encodings.mkdir()
    _corrupt_copy(encodings_dir() / f"{name}.tiktoken", encodings / f"{name}.tiktoken")
    monkeypatch.setattr(tokens, "encodings_dir", lambda: encodings)
    with pytest.raises(ValueError, match="shipped rank file is corrupt"):
        get_encoding(name)
    with pytest.raises(ValueError, match="shipped rank file is corrupt"):
        count_text("hello", "gpt-4o" if name == "o200k_base" else "gpt-4")


def test_truncated_rank_file_fails_the_hash_check(tmp_path: Path) -> None:
    truncated = tmp_path / "cl100k_base.tiktoken"
    truncated.write_bytes((encodings_dir() / "cl100k_base.tiktoken").read_bytes()[:-100])
    with pytest.raises(ValueError, match="Hash mismatch"):
        load_tiktoken_bpe(str(truncated), expected_hash=CL100K_SHA256)


def test_intact_copy_passes_the_hash_check(tmp_path: Path) -> None:
    copy = tmp_path / "o200k_base.tiktoken"
    shutil.copyfile(encodings_dir() / "o200k_base.tiktoken", copy)
    ranks = load_tiktoken_bpe(str(copy), expected_hash=O200K_SHA256)
    assert len(ranks) == 199_998


# --- model -> encoding --------------------------------------------------------


@pytest.mark.parametrize(
    "model",
    [
        "gpt-4o",
        "gpt-4o-mini",
        "gpt-4o-2024-08-06",
        "chatgpt-4o-latest",
        "gpt-4.1",
        "gpt-4.1-nano",
        "gpt-4.5-preview",
        "gpt-5",
        "gpt-5-mini",
        "o1",
        "o1-preview",
        "o3",
        "o3-mini",
        "o4-mini",
        "GPT-4O",
    ],
)
def test_recent_openai_models_count_exactly_with_o200k(model: str) -> None:
    assert encoding_for_model(model) == ("o200k_base", True)


@pytest.mark.parametrize(
    "model",
    [
        "gpt-4",
        "gpt-4-0613",
        "gpt-4-32k",
        "gpt-4-turbo",
        "gpt-3.5-turbo",
        "gpt-3.5-turbo-0125",
        "text-embedding-3-small",
        "text-embedding-ada-002",
    ],
)
def test_older_openai_models_count_exactly_with_cl100k(model: str) -> None:
    assert encoding_for_model(model) == ("cl100k_base", True)


@pytest.mark.parametrize(
    "model", ["claude-3-5-sonnet-20241022", "claude-opus-4", "llama-3.1-70b", "mistral-large"]
)
def test_models_without_a_published_tokenizer_are_estimated_with_o200k(model: str) -> None:
    assert encoding_for_model(model) == ("o200k_base", False)


def _tiktoken_openai_models() -> list[tuple[str, str]]:
    """Every model name and prefix tiktoken maps to an encoding we ship."""
    shipped = {"cl100k_base", "o200k_base"}
    pairs = [
        (model, enc) for model, enc in tiktoken.model.MODEL_TO_ENCODING.items() if enc in shipped
    ]
    pairs += [
        (prefix + "x", enc)
        for prefix, enc in tiktoken.model.MODEL_PREFIX_TO_ENCODING.items()
        if enc in shipped
    ]
    return sorted(pairs)


def test_every_model_tiktoken_maps_to_a_shipped_encoding_counts_exactly() -> None:
    """tiktoken.model is the published table: fine-tunes (ft:gpt-4o...), Azure
    deployment names (gpt-35-turbo) and davinci-002 have a known tokenizer and
    must be counted with it, not estimated with o200k and a 1.25 factor."""
    pairs = _tiktoken_openai_models()
    assert len(pairs) > 20
    wrong = {
        model: encoding_for_model(model)
        for model, encoding in pairs
        if encoding_for_model(model) != (encoding, True)
    }
    assert wrong == {}


def test_estimated_count_is_o200k_times_default_factor_rounded_up(
    o200k: tiktoken.Encoding,
) -> None:
    text = "The quick brown fox jumps over the lazy dog."  # 10 o200k tokens
    raw = len(o200k.encode(text))
    assert raw == 10
    count = count_text(text, "claude-3-5-sonnet")
    assert DEFAULT_ESTIMATE_FACTOR == 1.25
    assert count.tokens == math.ceil(raw * 1.25) == 13
    assert count.estimated is True
    assert count.encoding == "o200k_base"


def test_exact_count_is_not_scaled(cl100k: tiktoken.Encoding) -> None:
    count = count_text("hello world", "gpt-4", {"gpt-*": 3.0})
    assert (count.tokens, count.estimated, count.encoding) == (2, False, "cl100k_base")


def test_estimate_factor_is_configurable_by_exact_name_and_longest_prefix() -> None:
    factors = {"claude-*": 1.5, "claude-3-*": 1.1, "claude-3-opus": 2.0}
    assert estimate_factor("claude-3-opus", factors) == 2.0
    assert estimate_factor("claude-3-haiku", factors) == 1.1
    assert estimate_factor("claude-opus-4", factors) == 1.5
    assert estimate_factor("llama-3", factors) == DEFAULT_ESTIMATE_FACTOR
    assert estimate_factor("claude-opus-4", None) == DEFAULT_ESTIMATE_FACTOR
    # 10 raw tokens: ceil(10 * 1.1) = 11, ceil(10 * 1.5) = 15.
    text = "The quick brown fox jumps over the lazy dog."
    assert count_text(text, "claude-3-haiku", factors).tokens == 11
    assert count_text(text, "claude-opus-4", factors).tokens == 15


def test_estimate_factors_come_from_settings_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMQUOTA_ESTIMATE_FACTORS", '{"claude-*": 2.0}')
    settings = Settings(_env_file=None)  # type: ignore[call-arg]
    assert settings.estimate_factors == {"claude-*": 2.0}
    messages = [{"role": "user", "content": "hello world"}]
    # o200k: 3 priming + 3 framing + "user" (1) + "hello world" (2) = 9 -> ceil(18.0) = 18
    assert count_messages(messages, "claude-sonnet-4", settings.estimate_factors).tokens == 18


@pytest.mark.parametrize(
    "factor", [math.nan, math.inf, -1.0, 0.0], ids=["nan", "inf", "negative", "zero"]
)
def test_settings_refuse_estimate_factors_that_are_not_positive_and_finite(
    factor: float,
) -> None:
    """A NaN or infinite factor makes every claude-* admission raise ValueError /
    OverflowError from math.ceil; a negative one yields negative input_tokens
    that reach PostgreSQL and fail its CHECK; zero makes input free. The
    configuration must be refused when it is read, not at request time."""
    with pytest.raises(ValidationError):
        Settings(estimate_factors={"claude-*": factor}, _env_file=None)  # type: ignore[call-arg]


# --- chat framing ------------------------------------------------------------


def _framed(encoding: tiktoken.Encoding, messages: list[dict[str, str]]) -> int:
    """OpenAI cookbook arithmetic, from encoding.encode alone."""
    total = 3  # reply priming
    for message in messages:
        total += 3
        for key, value in message.items():
            total += len(encoding.encode(value))
            if key == "name":
                total += 1
    return total


CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant. Answer in one word."},
    {"role": "user", "name": "alice", "content": "What colour is the sky on a clear day?"},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "And at night?\n\nBe precise."},
]


@pytest.mark.parametrize(("model", "name"), [("gpt-4o", "o200k_base"), ("gpt-4", "cl100k_base")])
def test_chat_framing_is_three_per_message_three_priming_one_per_name(
    model: str, name: str
) -> None:
    encoding = get_encoding(name)
    expected = _framed(encoding, CONVERSATION)
    content_and_roles = sum(len(encoding.encode(v)) for m in CONVERSATION for v in m.values())
    assert expected == content_and_roles + 4 * 3 + 3 + 1
    count = count_messages(CONVERSATION, model)
    assert (count.tokens, count.encoding, count.estimated) == (expected, name, False)


def test_single_short_message_costs_nine_tokens() -> None:
    # 3 priming + 3 framing + "user" (1) + "hello world" (2), in both encodings.
    for model in ("gpt-4o", "gpt-4"):
        assert count_messages([{"role": "user", "content": "hello world"}], model).tokens == 9


def test_empty_conversation_costs_only_the_priming() -> None:
    assert count_messages([], "gpt-4o").tokens == 3


def test_content_blocks_count_their_text() -> None:
    o200k = get_encoding("o200k_base")
    blocks = [{"type": "text", "text": "first part"}, "second part"]
    expected = 3 + 3 + 1 + len(o200k.encode("first part")) + len(o200k.encode("second part"))
    assert count_messages([{"role": "user", "content": blocks}], "gpt-4o").tokens == expected


def test_special_token_text_is_counted_as_ordinary_text() -> None:
    message = [{"role": "user", "content": "<|endoftext|>"}]
    # 3 + 3 + "user" (1) + the seven ordinary pieces of "<|endoftext|>"
    assert count_messages(message, "gpt-4").tokens == 14


def test_estimated_chat_count_scales_the_framed_total() -> None:
    o200k = get_encoding("o200k_base")
    raw = _framed(o200k, CONVERSATION)
    count = count_messages(CONVERSATION, "claude-3-5-haiku")
    assert count.tokens == math.ceil(raw * 1.25)
    assert count.estimated is True


# --- bad shapes ----------------------------------------------------------------


@pytest.mark.parametrize(
    "messages",
    [
        "hello",
        b"hello",
        {"role": "user", "content": "hello"},
        ["hello"],
        [None],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": {"text": "x"}}],
        [{"role": 7, "content": "x"}],
        [{"role": "user", "name": ["x"], "content": "x"}],
        [{"role": "user", "content": [{"type": "mystery", "url": "x"}]}],
        [{"role": "user", "content": [5]}],
        42,
    ],
    ids=[
        "string",
        "bytes",
        "single-dict",
        "list-of-strings",
        "none-message",
        "int-content",
        "dict-content",
        "int-role",
        "list-name",
        "unknown-block",
        "int-block",
        "int",
    ],
)
def test_bad_message_shapes_raise_token_count_error(messages: Any) -> None:
    with pytest.raises(TokenCountError):
        count_messages(messages, "gpt-4o")


def test_token_count_error_is_a_value_error() -> None:
    assert issubclass(TokenCountError, ValueError)
