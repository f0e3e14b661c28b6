"""Input tokens of images, audio and documents in messages, as the providers count them.

Pure: no I/O. A prompt's media cost tokens the tokenizer cannot see; left
out, a request with a screenshot reserves a fraction of what it costs, and
refusing it would refuse a request the provider accepts. So each medium is
priced by the provider's documented rule where there is one, from the
image's size when it is inline (read from the file's header, never by
decoding the picture), and otherwise by a stated upper estimate. The figure
is always marked as an estimate (`input_estimated`): the provider's usage
settles the difference.

- OpenAI images (`image_url` parts), tile models: `detail: "low"` costs the
  base (85 for gpt-4o); otherwise the image is fitted into 2048x2048, scaled
  so its shortest side is at most 768, and costs base + tile price x its
  512-px tiles. A size we cannot read (a URL) is priced as the largest an
  image can cost after that scaling (2x4 tiles: 1,445 for gpt-4o). Patch
  models (gpt-4.1-mini/nano, o4-mini) cost their multiplier x the image's
  32-px patches, at most 1,536 patches.
- Anthropic images (`image` blocks): width x height / 750 after fitting the
  long edge into 1,568 px, at most 1,600 tokens (Anthropic's figure for the
  largest image it does not shrink further); unknown size: 1,600.
- Audio (`input_audio`): 10 tokens a second (OpenAI's figure for audio
  input); a WAV's duration is read from its header, any other format is
  assumed to be 8 kbit/s, so that the estimate errs long.
- Documents (OpenAI `file` parts, Anthropic `document` blocks): each page is
  both text and an image, so a page is priced at PAGE_TEXT_TOKENS plus the
  most an image costs; pages are counted from the PDF's page objects, and a
  document we cannot see (a URL, a file id) is UNKNOWN_DOCUMENT_PAGES pages.
  Plain-text documents are text, counted by the caller's tokenizer.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

OPENAI_MEDIA = frozenset({"image_url", "input_audio", "file"})
ANTHROPIC_MEDIA = frozenset({"image", "document"})
MEDIA_TYPES = OPENAI_MEDIA | ANTHROPIC_MEDIA


@dataclass(frozen=True, slots=True)
class TilePrice:
    """OpenAI's price of an image in tokens: a base, and so much per 512-px tile."""

    base: int
    tile: int


# Longest prefix wins; models not listed are priced as gpt-4o.
TILE_PRICES = {
    "gpt-4o-mini": TilePrice(2_833, 5_667),
    "o1": TilePrice(75, 150),
    "o3": TilePrice(75, 150),
}
DEFAULT_TILE_PRICE = TilePrice(85, 170)
# Patch models: tokens per 32-px patch (the image's patches, at most MAX_PATCHES).
PATCH_MULTIPLIERS = {"gpt-4.1-mini": 1.62, "gpt-4.1-nano": 2.46, "o4-mini": 1.72}
PATCH_PIXELS = 32
MAX_PATCHES = 1_536
OPENAI_MAX_SIDE = 2_048
OPENAI_SHORT_SIDE = 768
TILE_PIXELS = 512
# After fitting, no image has more tiles than this (768 x 2048).
MAX_TILES = math.ceil(OPENAI_SHORT_SIDE / TILE_PIXELS) * math.ceil(OPENAI_MAX_SIDE / TILE_PIXELS)
ANTHROPIC_LONG_EDGE = 1_568
ANTHROPIC_PIXELS_PER_TOKEN = 750
ANTHROPIC_MAX_IMAGE_TOKENS = 1_600
AUDIO_TOKENS_PER_SECOND = 10
# The slowest bitrate assumed for compressed audio: the longest, dearest reading.
ASSUMED_AUDIO_BYTES_PER_SECOND = 1_000
WAV_HEADER_BYTES = 44
PAGE_TEXT_TOKENS = 3_000
UNKNOWN_DOCUMENT_PAGES = 10
# An image's size is in its header: only this much of its base64 is decoded
# (a JPEG's frame header may follow 64 KiB of EXIF); not found there, the
# image is priced at the most it can cost.
IMAGE_HEADER_CHARS = 262_144
_T = TypeVar("_T")
_DATA_URL = re.compile(r"data:[^;,]*(?:;[^;,]*)*?;base64,", re.IGNORECASE)
_PDF_PAGE = re.compile(rb"/Type\s*/Page(?![a-zA-Z])")


def media_tokens(block: Mapping[str, Any], model: str) -> int:
    """The estimated input tokens of one media block (see the module's rules)."""
    kind = block.get("type")
    if kind == "image_url":
        return _openai_image(block.get("image_url"), model)
    if kind == "input_audio":
        audio = block.get("input_audio")
        data = audio.get("data") if isinstance(audio, Mapping) else None
        return _audio_tokens(_decoded(data) if isinstance(data, str) else None)
    if kind == "image":
        return _anthropic_image(_source_bytes(block.get("source"), IMAGE_HEADER_CHARS))
    page = PAGE_TEXT_TOKENS + max(_tile_price_max(model), ANTHROPIC_MAX_IMAGE_TOKENS)
    if kind == "file":
        file = block.get("file")
        data = file.get("file_data") if isinstance(file, Mapping) else None
        return page * _pages(_decoded(data) if isinstance(data, str) else None)
    return page * _pages(_source_bytes(block.get("source")))  # document


def _decoded(data: str, max_chars: int | None = None) -> bytes | None:
    """The bytes of base64 data, bare or as a data: URL (only its first `max_chars`
    characters when given); None if it is not base64."""
    match = _DATA_URL.match(data)
    payload = data[match.end() :] if match else data
    if max_chars is not None:
        payload = payload[:max_chars]
    try:
        return base64.b64decode(payload, validate=False)
    except (binascii.Error, ValueError):
        return None


def _source_bytes(source: object, max_chars: int | None = None) -> bytes | None:
    """The inline bytes of an Anthropic source (type base64), else None."""
    if isinstance(source, Mapping) and source.get("type") == "base64":
        data = source.get("data")
        return _decoded(data, max_chars) if isinstance(data, str) else None
    return None


def _openai_image(image: object, model: str) -> int:
    url = image.get("url") if isinstance(image, Mapping) else None
    detail = image.get("detail") if isinstance(image, Mapping) else None
    inline = isinstance(url, str) and url.startswith("data:")
    size = (
        image_size(_decoded(url, IMAGE_HEADER_CHARS)) if isinstance(url, str) and inline else None
    )
    multiplier = _longest(PATCH_MULTIPLIERS, model)
    if multiplier is not None:
        return math.ceil(_patches(size) * multiplier)
    price = _longest(TILE_PRICES, model) or DEFAULT_TILE_PRICE
    if detail == "low":
        return price.base
    return price.base + price.tile * (_tiles(*size) if size else MAX_TILES)


def _tile_price_max(model: str) -> int:
    """The most one image costs on `model` (a PDF page is also an image)."""
    multiplier = _longest(PATCH_MULTIPLIERS, model)
    if multiplier is not None:
        return math.ceil(MAX_PATCHES * multiplier)
    price = _longest(TILE_PRICES, model) or DEFAULT_TILE_PRICE
    return price.base + price.tile * MAX_TILES


def _tiles(width: int, height: int) -> int:
    """512-px tiles of an image after OpenAI's high-detail scaling."""
    scale = min(1.0, OPENAI_MAX_SIDE / max(width, height))
    scale *= min(1.0, OPENAI_SHORT_SIDE / (min(width, height) * scale))
    return math.ceil(width * scale / TILE_PIXELS) * math.ceil(height * scale / TILE_PIXELS)


def _patches(size: tuple[int, int] | None) -> int:
    """32-px patches of an image, shrunk as OpenAI does to at most MAX_PATCHES."""
    if size is None:
        return MAX_PATCHES
    width, height = size
    patches = math.ceil(width / PATCH_PIXELS) * math.ceil(height / PATCH_PIXELS)
    if patches <= MAX_PATCHES:
        return patches
    shrink = math.sqrt(PATCH_PIXELS**2 * MAX_PATCHES / (width * height))
    # Shrunk again so that one side is a whole number of patches.
    across, down = width * shrink / PATCH_PIXELS, height * shrink / PATCH_PIXELS
    shrink *= min(math.floor(across) / across, math.floor(down) / down)
    fitted = math.ceil(int(width * shrink) / PATCH_PIXELS) * math.ceil(
        int(height * shrink) / PATCH_PIXELS
    )
    return min(MAX_PATCHES, fitted)


def _anthropic_image(data: bytes | None) -> int:
    size = image_size(data)
    if size is None:
        return ANTHROPIC_MAX_IMAGE_TOKENS
    width, height = size
    scale = min(1.0, ANTHROPIC_LONG_EDGE / max(width, height))
    tokens = math.ceil(width * scale * height * scale / ANTHROPIC_PIXELS_PER_TOKEN)
    return min(tokens, ANTHROPIC_MAX_IMAGE_TOKENS)


def _audio_tokens(data: bytes | None) -> int:
    if data is None:
        return AUDIO_TOKENS_PER_SECOND * 60  # a minute: unreadable audio is not free
    seconds = len(data) / ASSUMED_AUDIO_BYTES_PER_SECOND
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE" and len(data) >= WAV_HEADER_BYTES:
        byte_rate = struct.unpack("<I", data[28:32])[0]
        if byte_rate > 0:
            seconds = (len(data) - WAV_HEADER_BYTES) / byte_rate
    return max(1, math.ceil(seconds * AUDIO_TOKENS_PER_SECOND))


def _pages(data: bytes | None) -> int:
    """Pages of a PDF by its page objects; a document we cannot see: the stated guess."""
    if data is None:
        return UNKNOWN_DOCUMENT_PAGES
    return max(1, len(_PDF_PAGE.findall(data)))


def _longest(table: Mapping[str, _T], model: str) -> _T | None:
    best = max((p for p in table if model.startswith(p)), key=len, default=None)
    return table[best] if best is not None else None


def image_size(data: bytes | None) -> tuple[int, int] | None:
    """(width, height) from a PNG, GIF, WebP or JPEG header; None if unreadable."""
    if not data:
        return None
    size: tuple[int, int] | None = None
    if data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) >= 24:
        size = struct.unpack(">II", data[16:24])
    elif data[:6] in (b"GIF87a", b"GIF89a") and len(data) >= 10:
        size = struct.unpack("<HH", data[6:10])
    elif data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        size = _webp_size(data)
    elif data[:2] == b"\xff\xd8":
        size = _jpeg_size(data)
    if size is None or size[0] < 1 or size[1] < 1:
        return None
    return size


def _webp_size(data: bytes) -> tuple[int, int] | None:
    chunk = data[12:16]
    if chunk == b"VP8X" and len(data) >= 30:
        width = int.from_bytes(data[24:27], "little") + 1
        return width, int.from_bytes(data[27:30], "little") + 1
    if chunk == b"VP8 " and len(data) >= 30:
        width, height = struct.unpack("<HH", data[26:30])
        return width & 0x3FFF, height & 0x3FFF
    if chunk == b"VP8L" and len(data) >= 25:
        bits = int.from_bytes(data[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    return None


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    """The size in a JPEG's start-of-frame marker, walking the segments before it."""
    position = 2
    while position + 9 <= len(data):
        if data[position] != 0xFF:
            return None
        marker = data[position + 1]
        length = struct.unpack(">H", data[position + 2 : position + 4])[0]
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            height, width = struct.unpack(">HH", data[position + 5 : position + 9])
            return width, height
        position += 2 + length
    return None
