"""The patterns names follow: tenants, routes, plans, ceilings, quotas, webhooks, models.

Pure, and the one place these patterns are written. The REST schemas (body
fields and path parameters, so the OpenAPI schema shows them), the library
(domain.validation) and the CLI all check against what is declared here,
so a name refused on one path is refused on every path.

Why so narrow: every name ends up in URLs, log lines, metrics labels and
the finance reports people open in spreadsheets and terminals. A name of
letters, digits and a little punctuation cannot smuggle a path segment
(`/`, `..`), a forged log or table line (a newline) or a terminal escape
(ESC) into any of them, nor (for object names) a formula's `=`, `+` or `@`.
A leading `-` stays allowed (`-` and `@` are part of model names, too), and
rows stored before these patterns existed may hold anything: the CLI's
output escaping (llmquota.cli.tabular) neutralises them without relying on
this module.
"""

from __future__ import annotations

import re
from typing import Annotated, TypeGuard

from pydantic import Field, StrictStr

from llmquota.domain.json_text import (
    is_unicode,
    matches,
    pattern_check,
    pattern_field,
    shown_text_pattern,
)

# Tenants, routes, plans, ceilings, quotas and webhooks: ASCII letters,
# digits, '-', '_' and '.', not starting with '.' (so never '.' or '..'),
# 1 to NAME_MAX_CHARS characters.
NAME_MAX_CHARS = 128
NAME_PATTERN = rf"^[A-Za-z0-9_-][A-Za-z0-9._-]{{0,{NAME_MAX_CHARS - 1}}}$"
NAME_RULE = (
    f"ASCII letters, digits, '-', '_' and '.', not starting with '.', "
    f"1 to {NAME_MAX_CHARS} characters"
)

# Models, as providers spell them (gpt-4o-2024-08-06, ft:gpt-4o:org::id,
# meta-llama/Llama-3-8b, claude-3-5-sonnet@20240620): ASCII letters, digits
# and '-', '.', '_', ':', '/', '@'; no spaces, no control characters.
MODEL_MAX_CHARS = 200
# "-" last, so that it is no range.
_MODEL_CHARS = r"A-Za-z0-9._:/@-"
MODEL_PATTERN = rf"^[{_MODEL_CHARS}]{{1,{MODEL_MAX_CHARS}}}$"
MODEL_RULE = (
    "ASCII letters, digits and '-', '.', '_', ':', '/', '@' (no spaces or control "
    f"characters), 1 to {MODEL_MAX_CHARS} characters"
)
# What a ceiling or a quota matches models with: model names, and `*` globs
# of them (gpt-4o-2024-*).
MODEL_GLOB_PATTERN = rf"^[*{_MODEL_CHARS}]{{1,{MODEL_MAX_CHARS}}}$"
MODEL_GLOB_RULE = f"{MODEL_RULE}, or '*' globs of them"

# The same rules as pydantic types, for request bodies: the schema (and with
# it the OpenAPI document) carries each pattern and its maximum length.
Name = Annotated[
    StrictStr,
    Field(min_length=1, max_length=NAME_MAX_CHARS, pattern=NAME_PATTERN, description=NAME_RULE),
]
ModelName = Annotated[
    StrictStr,
    Field(min_length=1, max_length=MODEL_MAX_CHARS, pattern=MODEL_PATTERN, description=MODEL_RULE),
]
ModelGlob = Annotated[
    StrictStr,
    Field(
        min_length=1,
        max_length=MODEL_MAX_CHARS,
        pattern=MODEL_GLOB_PATTERN,
        description=MODEL_GLOB_RULE,
    ),
]

_NAME = re.compile(NAME_PATTERN)
_MODEL = re.compile(MODEL_PATTERN)
_MODEL_GLOB = re.compile(MODEL_GLOB_PATTERN)


def is_name(value: object) -> TypeGuard[str]:
    """Whether `value` is a name of an object: a tenant, route, plan, ceiling, quota, webhook."""
    return isinstance(value, str) and _NAME.fullmatch(value) is not None


def is_model(value: object) -> TypeGuard[str]:
    """Whether `value` is a model name."""
    return isinstance(value, str) and _MODEL.fullmatch(value) is not None


def is_model_glob(value: object) -> TypeGuard[str]:
    """Whether `value` is a model name or a `*` glob of them."""
    return isinstance(value, str) and _MODEL_GLOB.fullmatch(value) is not None


# Upstreams (deployments) as UPSTREAMS_FILE names them, which a ceiling's
# `upstream` and an admission's `upstreams` refer to: free text there, so text
# safe to show here (json_text's rule: no control characters, line separators,
# bidirectional overrides or lone surrogates), 1 to UPSTREAM_NAME_MAX_CHARS.
UPSTREAM_NAME_MAX_CHARS = 128
UPSTREAM_NAME_PATTERN = shown_text_pattern(UPSTREAM_NAME_MAX_CHARS)
UPSTREAM_NAME_RULE = f"an upstream's name: 1 to {UPSTREAM_NAME_MAX_CHARS} printable characters"
UpstreamName = Annotated[
    StrictStr,
    pattern_field(UPSTREAM_NAME_PATTERN, UPSTREAM_NAME_MAX_CHARS, UPSTREAM_NAME_RULE),
    pattern_check(UPSTREAM_NAME_PATTERN, UPSTREAM_NAME_RULE),
]


def is_upstream_name(value: object) -> TypeGuard[str]:
    """Whether `value` is an upstream's name as UPSTREAM_NAME_PATTERN says."""
    return isinstance(value, str) and is_unicode(value) and matches(UPSTREAM_NAME_PATTERN, value)
