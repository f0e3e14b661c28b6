"""Pricing images, audio and documents in input tokens (llmquota.domain.media),
checked against the providers' own worked examples where they publish them."""

from __future__ import annotations

import base64
import struct
from typing import Any

import pytest

from llmquota.domain.media import (
    ANTHROPIC_MAX_IMAGE_TOKENS,
    PAGE_TEXT_TOKENS,
    UNKNOWN_DOCUMENT_PAGES,
    image_size,
    media_tokens,
)
from llmquota.domain.tokens import count_messages


def png(width: int, height: int) -> bytes:
    header = struct.pack(">II", width, height) + b"\x08\x02\x00\x00\x00"
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + header + b"\x00" * 4


def jpeg(width: int, height: int) -> bytes:
    app0 = b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\x00" + b"\x00" * 9
    sof = b"\xff\xc0" + struct.pack(">HBHH", 17, 8, height, width) + b"\x03" + b"\x00" * 9
    return b"\xff\xd8" + app0 + sof + b"\xff\xd9"


def gif(width: int, height: int) -> bytes:
    return b"GIF89a" + struct.pack("<HH", width, height) + b"\x00" * 8


def webp(width: int, height: int) -> bytes:
    bits = (width - 1) | ((height - 1) << 14)
    body = b"VP8L" + struct.pack("<I", 5) + b"\x2f" + struct.pack("<I", bits)
    return b"RIFF" + struct.pack("<I", 4 + len(body)) + b"WEBP" + body


def wav(seconds: float, rate: int = 16_000) -> bytes:
    data = b"\x00\x00" * int(rate * seconds)
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    return (
        b"RIFF" + struct.pack("<I", 36 + len(data)) + b"WAVE" + b"fmt " + struct.pack("<I", 16)
        + fmt + b"data" + struct.pack("<I", len(data)) + data
    )  # fmt: skip


def data_url(content: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(content).decode()}"


def openai_image(url: str, detail: str | None = None) -> dict[str, Any]:
    image: dict[str, Any] = {"url": url}
    if detail is not None:
        image["detail"] = detail
    return {"type": "image_url", "image_url": image}


@pytest.mark.parametrize(
    ("content", "size"),
    [
        (png(1024, 768), (1024, 768)),
        (jpeg(640, 480), (640, 480)),
        (gif(31, 17), (31, 17)),
        (webp(300, 200), (300, 200)),
        (b"not an image", None),
        (b"\x89PNG\r\n\x1a\n", None),
        (b"", None),
    ],
)
def test_image_size_is_read_from_the_header(content: bytes, size: tuple[int, int] | None) -> None:
    assert image_size(content) == size


@pytest.mark.parametrize(
    ("width", "height", "detail", "tokens"),
    [
        (1024, 1024, "high", 765),  # OpenAI's example: 768x768, 4 tiles
        (2048, 4096, "high", 1_105),  # OpenAI's example: 768x1536, 6 tiles
        (4096, 8192, "low", 85),  # low detail: the base, whatever the size
        (512, 512, None, 255),  # auto is priced as high: one tile
        (100, 100, "high", 255),  # never scaled up
    ],
)
def test_openai_tile_images_as_openai_documents_them(
    width: int, height: int, detail: str | None, tokens: int
) -> None:
    block = openai_image(data_url(png(width, height)), detail)
    assert media_tokens(block, "gpt-4o") == tokens


def test_an_openai_image_of_unknown_size_is_priced_at_the_most_it_can_cost() -> None:
    by_url = openai_image("https://example.com/cat.png")
    assert media_tokens(by_url, "gpt-4o") == 85 + 170 * 8  # 768x2048: 2x4 tiles
    assert media_tokens(openai_image("https://example.com/cat.png", "low"), "gpt-4o") == 85
    assert media_tokens(by_url, "gpt-4o-mini") == 2_833 + 5_667 * 8


def test_openai_patch_models_as_openai_documents_them() -> None:
    small = openai_image(data_url(png(1024, 1024)))
    assert media_tokens(small, "gpt-4.1-mini") == 1_659  # 1024 patches x 1.62
    large = openai_image(data_url(png(1800, 2400)))
    assert media_tokens(large, "gpt-4.1-mini") == 2_353  # 1452 patches x 1.62, rounded up
    assert media_tokens(openai_image("https://x/y.png"), "o4-mini") == 2_642  # 1536 x 1.72


def test_anthropic_images_as_anthropic_documents_them() -> None:
    def block(content: bytes | None) -> dict[str, Any]:
        if content is None:
            return {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}
        data = base64.b64encode(content).decode()
        return {"type": "image", "source": {"type": "base64", "media_type": "x", "data": data}}

    assert media_tokens(block(jpeg(200, 200)), "claude-sonnet-4") == 54
    assert media_tokens(block(png(1092, 1092)), "claude-sonnet-4") == 1_590
    assert media_tokens(block(png(4000, 4000)), "claude-sonnet-4") == ANTHROPIC_MAX_IMAGE_TOKENS
    assert media_tokens(block(None), "claude-sonnet-4") == ANTHROPIC_MAX_IMAGE_TOKENS


def test_audio_is_ten_tokens_a_second_read_from_a_wav_or_assumed_slow() -> None:
    def block(content: bytes, form: str) -> dict[str, Any]:
        data = base64.b64encode(content).decode()
        return {"type": "input_audio", "input_audio": {"data": data, "format": form}}

    assert media_tokens(block(wav(2.0), "wav"), "gpt-4o-audio-preview") == 20
    assert media_tokens(block(b"\xff" * 5_000, "mp3"), "gpt-4o-audio-preview") == 50


def test_documents_are_priced_per_page_as_text_and_an_image() -> None:
    pdf = b"%PDF-1.7\n1 0 obj <</Type /Pages /Count 2>>\n2 0 obj <</Type /Page>>\n"
    pdf += b"3 0 obj <</Type/Page>>"
    page = PAGE_TEXT_TOKENS + ANTHROPIC_MAX_IMAGE_TOKENS
    file = {"type": "file", "file": {"file_data": data_url(pdf, "application/pdf")}}
    assert media_tokens(file, "gpt-4o") == 2 * page
    by_id = {"type": "file", "file": {"file_id": "file-abc"}}
    assert media_tokens(by_id, "gpt-4o") == UNKNOWN_DOCUMENT_PAGES * page
    data = base64.b64encode(pdf).decode()
    document = {"type": "document", "source": {"type": "base64", "data": data}}
    assert media_tokens(document, "claude-sonnet-4") == 2 * page


def test_counting_messages_adds_media_and_marks_the_count_estimated() -> None:
    text_only = count_messages([{"role": "user", "content": "What is this?"}], "gpt-4o")
    assert not text_only.estimated
    with_image = count_messages(
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    openai_image(data_url(png(1024, 1024))),
                ],
            }
        ],
        "gpt-4o",
    )
    assert with_image.estimated and with_image.tokens == text_only.tokens + 765
    # Media are in the provider's tokens: the tokenizer's estimate factor does not scale them.
    claude_text = count_messages([{"role": "user", "content": "hi"}], "claude-sonnet-4")
    claude = count_messages(
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "hi"},
                    {"type": "image", "source": {"type": "url", "url": "https://x"}},
                    {"type": "document", "source": {"type": "text", "data": "plain words"}},
                ],
            }
        ],
        "claude-sonnet-4",
    )
    assert claude.tokens > claude_text.tokens + ANTHROPIC_MAX_IMAGE_TOKENS
    assert claude.tokens < claude_text.tokens + ANTHROPIC_MAX_IMAGE_TOKENS + 10


def test_only_an_images_header_is_decoded_and_a_far_header_costs_the_most() -> None:
    app1 = b"\xff\xe1" + struct.pack(">H", 65_000) + b"\x00" * 64_998  # EXIF-sized segments
    near, far = jpeg(100, 100), jpeg(100, 100)
    near = near[:2] + app1 + near[2:]
    far = far[:2] + app1 * 5 + far[2:]  # the frame header past IMAGE_HEADER_CHARS
    assert media_tokens(openai_image(data_url(near, "image/jpeg")), "gpt-4o") == 85 + 170
    assert media_tokens(openai_image(data_url(far, "image/jpeg")), "gpt-4o") == 85 + 170 * 8
