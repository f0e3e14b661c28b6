"""The most output tokens each model can produce, for requests that give no max_tokens.

The proxy must reserve something for the output of a request without
`max_tokens`; reserving too little lets a tenant overrun its limit by a whole
answer, and a silent round number (1024) is wrong for every model. So the
default is the model's own ceiling, from the providers' published figures
below (longest matching prefix wins), and a model missing here has no
default: the operator sets LLMQUOTA_PROXY_DEFAULT_MAX_TOKENS or the caller
gives max_tokens. Pure data.
"""

from __future__ import annotations

# Prefix -> maximum output tokens, as the providers document them.
MAX_OUTPUT_TOKENS: dict[str, int] = {
    "gpt-3.5-turbo": 4_096,
    "gpt-4": 8_192,
    "gpt-4-turbo": 4_096,
    "gpt-4o": 16_384,
    "gpt-4o-mini": 16_384,
    "chatgpt-4o": 16_384,
    "gpt-4.1": 32_768,
    "gpt-4.5": 16_384,
    "gpt-5": 128_000,
    "o1": 100_000,
    "o1-mini": 65_536,
    "o3": 100_000,
    "o3-mini": 100_000,
    "o4-mini": 100_000,
    "claude-3-haiku": 4_096,
    "claude-3-opus": 4_096,
    "claude-3-sonnet": 4_096,
    "claude-3-5-haiku": 8_192,
    "claude-3-5-sonnet": 8_192,
    "claude-3-7-sonnet": 64_000,
    "claude-haiku-4": 64_000,
    "claude-sonnet-4": 64_000,
    "claude-opus-4": 32_000,
    "claude-opus-4-5": 64_000,
}


def max_output_tokens(model: str) -> int | None:
    """The model's maximum output by the longest matching prefix; None if unknown."""
    best = max((p for p in MAX_OUTPUT_TOKENS if model.startswith(p)), key=len, default=None)
    return MAX_OUTPUT_TOKENS[best] if best is not None else None
