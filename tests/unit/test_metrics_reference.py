"""docs/operations.md's Metrics tables are the registry and the reasons, exactly.

An operator reads that section to write alerts and dashboards, so a series
added, renamed or relabelled in code but not in the docs, or a row for a
series that is gone, fails here; so does a `reason` value the code can emit
that the "Refusal reasons" table lacks, or one it lists that no code emits.

The series come from a real registry built as `api/app.py` builds it: the
limiter's Metrics, plus the proxy's series on the same registry
(`Proxy(settings, limiter.metrics.registry)` ends in `ProxyMetrics(registry)`).
The reasons come from the vocabularies the code uses: decision_reason's
REASONS, the refusal body's REFUSAL_REASONS, the denials' and the
authentication refusals' label values.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any, get_args

from prometheus_client import CollectorRegistry

from llmquota.api.proxy.metrics import ProxyMetrics
from llmquota.domain.records import AdmitDecision, TenantFigures
from llmquota.domain.vocabulary import (
    REASONS,
    REFUSAL_REASONS,
    SCOPES,
    AdmitStatus,
    LimitKind,
    RefusalReason,
)
from llmquota.metrics import (
    AUTH_REFUSAL_REASONS,
    DENIAL_REASONS,
    AuthRefusalReason,
    Metrics,
    decision_reason,
)

OPERATIONS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
SERIES_HEADER = "| series | type | labels | what |\n| --- | --- | --- | --- |"
REASONS_HEADER = "| reason | carried by | what it means to an operator |\n| --- | --- | --- |"
# An unlabelled series has an empty labels cell: "| |".
_SERIES_ROW = re.compile(
    r"^\| `(llmquota_[a-z0-9_]+)` \| (counter|gauge|histogram) \|\s*(.*?)\s*\| .+ \|$"
)
_REASON_ROW = re.compile(r"^\| `([a-z_]+)` \| (.+?) \| .+ \|$")
_CODE = re.compile(r"`([^`]+)`")
# Where each reason vocabulary shows: a series' `reason` label, or the body field.
BODY = "refusal body"
CARRIERS: dict[str, tuple[str, ...]] = {
    "llmquota_decisions_total": REASONS,
    "llmquota_denials_total": DENIAL_REASONS,
    "llmquota_policy_denials_total": DENIAL_REASONS,
    "llmquota_auth_refusals_total": AUTH_REFUSAL_REASONS,
    BODY: REFUSAL_REASONS,
}


def registry() -> CollectorRegistry:
    """The registry `GET /metrics` renders, with everything app.py puts on it."""
    metrics = Metrics()
    ProxyMetrics(metrics.registry)
    return metrics.registry


def exported_series() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Each family as Prometheus shows it (counters with `_total`) -> (type, labels).

    Label names are the collector's own (`_labelnames`): a labelled series
    with no children yet has no samples to read them from.
    """
    series: dict[str, tuple[str, tuple[str, ...]]] = {}
    # No public way to reach a registry's collectors; this attribute has been there
    # since prometheus_client 0.0.x.
    for collector in registry()._collector_to_names:
        labels: tuple[str, ...] = tuple(getattr(collector, "_labelnames", ()))
        for family in collector.collect():
            name = family.name + "_total" if family.type == "counter" else family.name
            series[name] = (family.type, labels)
    return series


def _section(heading: str, until: str) -> str:
    text = OPERATIONS.read_text(encoding="utf-8")
    start = text.index(f"\n{heading}\n")
    end = text.find(until, start + len(heading) + 2)
    return text[start : end if end != -1 else len(text)]


def _series_section() -> str:
    return _section("## Metrics", "\n### Refusal reasons\n")


def _reasons_section() -> str:
    return _section("### Refusal reasons", "\n## ")


def docs_series() -> dict[str, tuple[str, tuple[str, ...]]]:
    """name -> (type, label names) of every row of the series table, in order."""
    rows: dict[str, tuple[str, tuple[str, ...]]] = {}
    for line in _series_section().splitlines():
        if found := _SERIES_ROW.match(line):
            name, kind, labels = found.groups()
            assert name not in rows, f"{name} listed twice"
            rows[name] = (kind, tuple(_CODE.findall(labels)))
    return rows


def docs_reasons() -> dict[str, set[str]]:
    """reason -> what its "carried by" cell names, for every row of the reasons table."""
    rows: dict[str, set[str]] = {}
    for line in _reasons_section().splitlines():
        if found := _REASON_ROW.match(line):
            reason, carried_by = found.groups()
            assert reason not in rows, f"{reason} listed twice"
            carriers = set(_CODE.findall(carried_by)) | ({BODY} if BODY in carried_by else set())
            rows[reason] = carriers
    return rows


def expected_reasons() -> dict[str, set[str]]:
    """reason -> every series (or the body) that carries it, from the code's vocabularies."""
    expected: dict[str, set[str]] = {}
    for carrier, reasons in CARRIERS.items():
        for reason in reasons:
            expected.setdefault(reason, set()).add(carrier)
    return expected


def test_the_series_table_lists_every_exported_family_with_its_type_and_labels() -> None:
    exported, documented = exported_series(), docs_series()
    assert sorted(exported.keys() - documented.keys()) == [], "series missing from the docs"
    assert sorted(documented.keys() - exported.keys()) == [], "docs list series not exported"
    for name, (kind, labels) in exported.items():
        assert documented[name] == (kind, labels), name
    assert len(exported) == 41


def test_the_tables_keep_their_headers() -> None:
    """A table that loses its header row renders as text, not as a table."""
    assert SERIES_HEADER in _series_section()
    assert REASONS_HEADER in _reasons_section()


def test_the_reasons_table_lists_every_reason_and_where_it_shows() -> None:
    assert docs_reasons() == expected_reasons()


def test_every_reason_label_is_documented_as_a_carrier() -> None:
    """A new series with a `reason` label must say which vocabulary it speaks."""
    labelled = {name for name, (_t, labels) in exported_series().items() if "reason" in labels}
    assert labelled == CARRIERS.keys() - {BODY}


def test_the_tuples_are_the_typed_vocabularies() -> None:
    assert get_args(RefusalReason) == REFUSAL_REASONS
    assert get_args(AuthRefusalReason) == AUTH_REFUSAL_REASONS
    assert len(set(REASONS)) == len(REASONS)


def _decision(status: str, **fields: Any) -> AdmitDecision:
    values: dict[str, Any] = dict.fromkeys(AdmitDecision._fields)
    values.update(status=status, tenant=TenantFigures(None, None, None, None, None, None))
    values.update(fields)
    return AdmitDecision(**values)


def test_decision_reason_only_ever_answers_one_of_reasons() -> None:
    """Every status, limit kind, scope and refusal reason a decision can carry."""
    statuses: tuple[AdmitStatus, ...] = get_args(AdmitStatus)
    kinds: tuple[LimitKind | None, ...] = (None, "tokens", "requests", "concurrency")
    reasons: tuple[RefusalReason | None, ...] = (None, *REFUSAL_REASONS)
    seen = set()
    for status, kind, scope, why in itertools.product(statuses, kinds, (None, *SCOPES), reasons):
        seen.add(decision_reason(_decision(status, limit_kind=kind, limit_scope=scope, reason=why)))
    assert seen == set(REASONS)
