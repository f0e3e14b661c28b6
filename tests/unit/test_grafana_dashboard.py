"""docs/grafana-dashboard.json charts exactly the series the code exports.

A dashboard naming a series the code does not export shows an empty panel
nobody notices; a series of plans, ceilings or waiting missing from it is
one nobody watches. Both are checked against a real Metrics registry.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from llmquota.api.proxy.metrics import ProxyMetrics
from llmquota.metrics import Metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json"
SERIES_NAME = re.compile(r"\bllmquota_[a-z0-9_]+")
# Sample names each family type exposes in the text format.
SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
}
# The series of plans, ceilings, degradation and waiting (issue 9), as families.
DASHBOARD_FAMILIES = {
    "llmquota_decisions",
    "llmquota_degradations",
    "llmquota_reserved_tokens",
    "llmquota_charged_tokens",
    "llmquota_ceiling_utilization",
    "llmquota_tenant_utilization",
    "llmquota_decision_seconds",
    "llmquota_waiting_admissions",
    "llmquota_wait_seconds",
    # proxy mode's serving paths (issue 23): fallback vs reject, latency by path
    "llmquota_serving_path",
    "llmquota_serving_path_seconds",
}


def _exported() -> dict[str, str]:
    """Every sample name the registry can expose -> its family's name."""
    names: dict[str, str] = {}
    metrics = Metrics()
    ProxyMetrics(metrics.registry)  # on the same registry, as api/app.py builds it
    for family in metrics.registry.collect():
        for suffix in SUFFIXES[family.type]:
            names[family.name + suffix] = family.name
    return names


def _expressions() -> list[str]:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def test_every_series_on_the_dashboard_is_exported() -> None:
    exported = _exported()
    used = {name for expr in _expressions() for name in SERIES_NAME.findall(expr)}
    assert used, "no llmquota series on the dashboard"
    assert used - exported.keys() == set()


def test_the_dashboard_shows_every_series_of_plans_ceilings_and_waiting() -> None:
    exported = _exported()
    assert set(exported.values()) >= DASHBOARD_FAMILIES  # the list names real families
    shown = {exported[n] for expr in _expressions() for n in SERIES_NAME.findall(expr)}
    assert shown == DASHBOARD_FAMILIES


def test_every_panel_reads_from_the_chosen_prometheus() -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["datasource"]
    for panel in dashboard["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
