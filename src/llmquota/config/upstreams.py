"""Proxy upstreams: the simple per-format variables and LLMQUOTA_UPSTREAMS_FILE.

The simple variables (LLMQUOTA_OPENAI_BASE_URL with _API_KEY, and the same for
ANTHROPIC) give one upstream per wire format that serves every model of that
format. The upstreams file (TOML) gives several, each serving the models its
`models` list names, exactly or by `*` glob:

    [[upstream]]
    name = "openai-main"
    format = "openai"                       # or "anthropic"
    base_url = "https://api.openai.com/v1"  # as the format's SDK takes it
    api_key_env = "OPENAI_KEY"              # or api_key_file = "/run/secrets/openai"
    connect_timeout_seconds = 5             # optional, else the PROXY_* settings
    read_timeout_seconds = 300
    models = ["gpt-4o", "gpt-4o-*", "o3*"]
    price_factor = 1.0                      # optional: its price against the catalogue's

The same model may be listed under several upstreams (deployments, say an
OpenAI one and an Azure one). Which of them serves is a routing rule, given per
model glob in `[[routing]]` tables (the first whose `models` matches wins):

    [[routing]]
    models = ["gpt-4o*"]
    rule = "cheapest"                       # "order" (the default), "cheapest", "least_utilized"

`order` tries the deployments that name the model exactly, then those whose
glob matches it, each in file order; `cheapest` the lowest `price_factor`
first (ties in that order); `least_utilized` the one whose own provider
ceilings (a ceiling's `upstream`) have the most room left, decided in the
admission statement with every other limit (sql/admission.sql). Under every
rule, a deployment whose ceilings lack room is passed over for the next in
the same statement, so spillover is exact under any concurrency. The tenant
is charged the catalogue's price whichever deployment serves: `price_factor`
only ranks deployments.

The file is read once, at start-up, and every mistake in it is refused then
with the file and the field named: a typo found at the first request would
refuse a tenant's call instead of the operator's deployment. The keys it
points to are read here too (the environment through `environment_value`,
the one reader), and no message ever contains a key.
"""

from __future__ import annotations

import functools
import math
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import SecretStr

WireFormat = Literal["openai", "anthropic"]
WIRE_FORMATS: tuple[WireFormat, ...] = ("openai", "anthropic")
# Bounds on what one file may declare, so a generated file cannot make routing slow.
MAX_UPSTREAMS = 64
MAX_MODEL_PATTERNS = 1_000
MAX_TIMEOUT_SECONDS = 3_600.0
_FIELDS = frozenset(
    {
        "name",
        "format",
        "base_url",
        "api_key_env",
        "api_key_file",
        "connect_timeout_seconds",
        "read_timeout_seconds",
        "models",
        "price_factor",
    }
)
RoutingRuleName = Literal["order", "cheapest", "least_utilized"]
ROUTING_RULES: tuple[RoutingRuleName, ...] = ("order", "cheapest", "least_utilized")
MAX_PRICE_FACTOR = 1_000.0
# Any model of the format: what an upstream from the simple variables serves.
EVERY_MODEL = ("*",)


class UpstreamsFileError(ValueError):
    """The upstreams file cannot be used; the message names the file and the field."""


@dataclass(frozen=True, slots=True)
class UpstreamConfig:
    """One provider endpoint: its format, where it is, its key, timeouts, models."""

    name: str
    format: WireFormat
    base_url: str
    api_key: SecretStr
    models: tuple[str, ...]
    connect_timeout_seconds: float | None = None
    read_timeout_seconds: float | None = None
    price_factor: float = 1.0

    def serves(self, model: str) -> Literal["exact", "glob", None]:
        """How this upstream names `model`: exactly, by a glob, or not at all."""
        if model in self.models:
            return "exact"
        if any("*" in p and _glob(p).fullmatch(model) for p in self.models):
            return "glob"
        return None


@functools.lru_cache(maxsize=MAX_MODEL_PATTERNS)
def _glob(pattern: str) -> re.Pattern[str]:
    """A `models` glob: `*` is any run of characters; everything else is itself."""
    return re.compile(".*".join(re.escape(part) for part in pattern.split("*")), re.DOTALL)


@dataclass(frozen=True, slots=True)
class RoutingRule:
    """How the deployments of the models `models` names are ranked ([[routing]])."""

    models: tuple[str, ...]
    rule: RoutingRuleName

    def applies(self, model: str) -> bool:
        return any(_glob(p).fullmatch(model) for p in self.models)


def deployments(
    upstreams: tuple[UpstreamConfig, ...],
    form: WireFormat,
    model: str,
    rules: tuple[RoutingRule, ...] = (),
) -> list[UpstreamConfig]:
    """Every upstream of `form` serving `model`, ranked by the model's routing rule:
    exact names before globs, in file order (`order`, and `least_utilized`, which
    the admission statement ranks again by room), or by price (`cheapest`)."""
    served = [u for u in upstreams if u.format == form]
    ranked = [u for u in served if u.serves(model) == "exact"]
    ranked += [u for u in served if u.serves(model) == "glob"]
    if routing_rule(model, rules) == "cheapest":
        ranked.sort(key=lambda u: u.price_factor)  # stable: ties keep their order
    return ranked


def routing_rule(model: str, rules: tuple[RoutingRule, ...]) -> RoutingRuleName:
    """The rule of the first [[routing]] table whose `models` match `model`; `order`."""
    return next((r.rule for r in rules if r.applies(model)), "order")


def route(
    upstreams: tuple[UpstreamConfig, ...],
    form: WireFormat,
    model: str,
    rules: tuple[RoutingRule, ...] = (),
) -> UpstreamConfig | None:
    """The first-ranked upstream of `form` serving `model`; None if none does."""
    ranked = deployments(upstreams, form, model, rules)
    return ranked[0] if ranked else None


def load_upstreams_file(
    path: str, environment: Callable[[str], str | None]
) -> tuple[list[UpstreamConfig], tuple[RoutingRule, ...]]:
    """Every upstream and routing rule the file declares, checked; raises
    UpstreamsFileError."""
    try:
        document = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise UpstreamsFileError(f"{path}: cannot be read ({exc.strerror})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UpstreamsFileError(f"{path}: is not valid TOML ({exc})") from None
    extra = set(document) - {"upstream", "routing"}
    if extra:
        raise UpstreamsFileError(
            f"{path}: unknown table {sorted(extra)[0]!r}; use [[upstream]] or [[routing]]"
        )
    entries = document.get("upstream")
    if not isinstance(entries, list) or not entries:
        raise UpstreamsFileError(f"{path}: declares no [[upstream]]")
    if len(entries) > MAX_UPSTREAMS:
        raise UpstreamsFileError(f"{path}: more than {MAX_UPSTREAMS} upstreams")
    upstreams = [
        _upstream(f"{path}: upstream[{i}]", entry, environment) for i, entry in enumerate(entries)
    ]
    return upstreams, _routing(path, document.get("routing", []))


def _routing(path: str, tables: object) -> tuple[RoutingRule, ...]:
    """The [[routing]] tables: each a `models` list of globs and a `rule`."""
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise UpstreamsFileError(f"{path}: routing must be [[routing]] tables")
    if len(tables) > MAX_UPSTREAMS:
        raise UpstreamsFileError(f"{path}: more than {MAX_UPSTREAMS} routing tables")
    rules = []
    for i, table in enumerate(tables):
        where = f"{path}: routing[{i}]"
        unknown = set(table) - {"models", "rule"}
        if unknown:
            raise UpstreamsFileError(f"{where}.{sorted(unknown)[0]}: unknown field")
        rule = table.get("rule")
        if rule not in ROUTING_RULES:
            raise UpstreamsFileError(
                f"{where}.rule: must be 'order', 'cheapest' or 'least_utilized'"
            )
        rules.append(RoutingRule(_models(where, table), rule))
    return tuple(rules)


def _models(where: str, entry: Mapping[str, Any]) -> tuple[str, ...]:
    models = entry.get("models")
    if (
        not isinstance(models, list)
        or not models
        or len(models) > MAX_MODEL_PATTERNS
        or not all(isinstance(m, str) and m for m in models)
    ):
        raise UpstreamsFileError(
            f"{where}.models: must be a list of 1 to {MAX_MODEL_PATTERNS} model names or globs"
        )
    return tuple(models)


def _upstream(
    where: str, entry: Mapping[str, Any], environment: Callable[[str], str | None]
) -> UpstreamConfig:
    """One [[upstream]] table, checked field by field."""
    unknown = set(entry) - _FIELDS
    if unknown:
        raise UpstreamsFileError(f"{where}.{sorted(unknown)[0]}: unknown field")
    name = _string(where, entry, "name")
    where = f"{where} ({name})"
    form = _string(where, entry, "format")
    if form not in WIRE_FORMATS:
        raise UpstreamsFileError(f"{where}.format: must be 'openai' or 'anthropic'")
    base_url = _string(where, entry, "base_url")
    if not base_url.startswith(("http://", "https://")):
        raise UpstreamsFileError(f"{where}.base_url: must start with http:// or https://")
    return UpstreamConfig(
        name=name,
        format=form,
        base_url=base_url,
        api_key=_key(where, entry, environment),
        models=_models(where, entry),
        connect_timeout_seconds=_timeout(where, entry, "connect_timeout_seconds"),
        read_timeout_seconds=_timeout(where, entry, "read_timeout_seconds"),
        price_factor=_price_factor(where, entry),
    )


def _price_factor(where: str, entry: Mapping[str, Any]) -> float:
    value = entry.get("price_factor", 1.0)
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not 0 < value <= MAX_PRICE_FACTOR
    ):
        raise UpstreamsFileError(
            f"{where}.price_factor: a number above 0, at most {MAX_PRICE_FACTOR:g}"
        )
    return float(value)


def _string(where: str, entry: Mapping[str, Any], field: str) -> str:
    value = entry.get(field)
    if not isinstance(value, str) or not value.strip():
        raise UpstreamsFileError(f"{where}.{field}: required, a non-empty string")
    return value.strip()


def _timeout(where: str, entry: Mapping[str, Any], field: str) -> float | None:
    value = entry.get(field)
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not 0 < value <= MAX_TIMEOUT_SECONDS
    ):
        raise UpstreamsFileError(
            f"{where}.{field}: seconds, above 0, at most {MAX_TIMEOUT_SECONDS:g}"
        )
    return float(value)


def _key(
    where: str, entry: Mapping[str, Any], environment: Callable[[str], str | None]
) -> SecretStr:
    """The provider key, from the variable or the file named; never echoed in an error."""
    variable, file = entry.get("api_key_env"), entry.get("api_key_file")
    if (variable is None) == (file is None):
        raise UpstreamsFileError(f"{where}: give exactly one of api_key_env or api_key_file")
    if variable is not None:
        name = _string(where, entry, "api_key_env")
        key = environment(name)
        if not key or not key.strip():
            raise UpstreamsFileError(f"{where}.api_key_env: the variable {name} is not set")
        return SecretStr(key.strip())
    key_path = _string(where, entry, "api_key_file")
    try:
        key = Path(key_path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise UpstreamsFileError(
            f"{where}.api_key_file: {key_path} cannot be read ({reason})"
        ) from None
    if not key:
        raise UpstreamsFileError(f"{where}.api_key_file: {key_path} is empty")
    return SecretStr(key)


def check_names(upstreams: list[UpstreamConfig], path: str | None) -> None:
    """Names tell upstreams apart in logs and metrics: each must be unique."""
    seen: set[str] = set()
    for upstream in upstreams:
        if upstream.name in seen:
            where = f"{path}: " if path else ""
            raise UpstreamsFileError(f"{where}upstream name {upstream.name!r} is used twice")
        seen.add(upstream.name)
