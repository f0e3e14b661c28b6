"""README.md's Configuration tables are the settings, exactly: none missing, none stale.

Each table row is a variable, its default and its meaning; the expected rows
are derived from the pydantic model (`Settings.model_fields`: the default,
the Field description) and from COMMAND_DEFAULTS, grouped by
`config.catalogue.TOPICS`. A field added without a topic, a default changed
in code but not in the README, or a row for a setting that is gone fails here,
and the failure prints the section as it should read.
"""

from __future__ import annotations

import re
from pathlib import Path

from llmquota.config import Settings
from llmquota.config.catalogue import TOPICS, UNSET, Entry, entries, is_secret

README = Path(__file__).resolve().parents[2] / "README.md"
HEADER = "| Variable | Default | Meaning |\n| --- | --- | --- |"
_ROW = re.compile(r"^\| `(LLMQUOTA_[A-Z0-9_]+)` \| (.*?) \| (.*) \|$")


def _default_cell(value: str | None) -> str:
    if value is None:
        return UNSET
    return "empty" if value == "" else f"`{value}`"


def expected_tables() -> str:
    """The Configuration tables as the code declares them, in markdown."""
    parts: list[str] = []
    topic = None
    for entry in entries():
        if entry.topic != topic:
            topic = entry.topic
            parts.append(f"\n### {topic}\n\n{HEADER}")
        parts.append(f"| `{entry.variable}` | {_default_cell(entry.value)} | {entry.meaning} |")
    return "\n".join(parts).strip() + "\n"


def _configuration_section() -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index("\n## Configuration\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def readme_rows() -> list[tuple[str, str, str, str]]:
    """(topic, variable, default cell, meaning) of every table row, in order."""
    rows = []
    topic = ""
    for line in _configuration_section().splitlines():
        if line.startswith("### "):
            topic = line.removeprefix("### ")
        elif found := _ROW.match(line):
            rows.append((topic, *found.groups()))
    return rows


def _expected_rows() -> list[tuple[str, str, str, str]]:
    return [(e.topic, e.variable, _default_cell(e.value), e.meaning) for e in entries()]


def test_every_settings_field_has_exactly_one_topic() -> None:
    listed = [name for _title, names in TOPICS for name in names]
    assert sorted(listed) == sorted(Settings.model_fields)
    assert len(listed) == len(set(listed)) == 102


def test_readme_tables_list_every_setting_with_its_real_default_and_description() -> None:
    rows = readme_rows()
    assert rows == _expected_rows(), "README.md's Configuration should read:\n" + expected_tables()
    assert len(rows) == 102 + 31  # the settings, then the command flags' variables


def test_readme_tables_are_laid_out_as_generated() -> None:
    """Headings, table headers and rows verbatim, so a table cannot lose its header."""
    assert expected_tables() in _configuration_section()


def test_defaults_are_the_models_as_one_would_type_them() -> None:
    cells = {variable: default for _t, variable, default, _m in readme_rows()}
    assert cells["LLMQUOTA_DECISION_DEADLINE_MS"] == "`250`"
    assert cells["LLMQUOTA_RETENTION_SECONDS"] == "`604800`"
    assert cells["LLMQUOTA_OUTAGE_LOCAL_FRACTION"] == "`0.25`"
    assert cells["LLMQUOTA_SERVE_SWEEPER"] == "`true`"
    assert cells["LLMQUOTA_ESTIMATE_FACTORS"] == "`{}`"
    assert cells["LLMQUOTA_WEBHOOK_ALLOWED_NETWORKS"] == "empty"
    assert cells["LLMQUOTA_DATABASE_URL"] == UNSET
    assert cells["LLMQUOTA_PORT"] == "`8080`"
    assert Settings.model_fields["decision_deadline_ms"].default == 250


def test_secrets_are_shown_masked_and_urls_lose_only_their_credentials() -> None:
    settings = Settings(  # type: ignore[call-arg]
        _env_file=None,
        admin_key="lq_admin_secret_value",
        metrics_token="metrics-token-0123456789",
        database_url="postgresql://app:dbpass@db.internal:5432/llmquota?sslmode=require",
        reporting_database_url="host=db user=finance password=kwpass",
        openai_base_url="https://api.openai.com/v1",
        openai_api_key="sk-provider-secret",
    )
    shown: dict[str, Entry] = {e.variable: e for e in entries(settings)}
    assert shown["LLMQUOTA_ADMIN_KEY"].value == "***"
    assert shown["LLMQUOTA_METRICS_TOKEN"].value == "***"
    assert shown["LLMQUOTA_OPENAI_API_KEY"].value == "***"
    assert shown["LLMQUOTA_ANTHROPIC_API_KEY"].value is None
    assert (
        shown["LLMQUOTA_DATABASE_URL"].value
        == "postgresql://app:***@db.internal:5432/llmquota?sslmode=require"
    )
    assert shown["LLMQUOTA_REPORTING_DATABASE_URL"].value == "***"
    assert shown["LLMQUOTA_OPENAI_BASE_URL"].value == "https://api.openai.com/v1"
    everything = " ".join(str(e.value) for e in shown.values())
    for secret in ("lq_admin_secret_value", "metrics-token", "dbpass", "kwpass", "sk-provider"):
        assert secret not in everything


def test_the_secret_settings_are_the_keys_and_tokens() -> None:
    secret = {name for name, field in Settings.model_fields.items() if is_secret(name, field)}
    assert secret == {"admin_key", "metrics_token", "openai_api_key", "anthropic_api_key"}
    urls = {name for name in Settings.model_fields if name.endswith("_url")}
    assert urls == {
        "database_url",
        "listen_database_url",
        "reporting_database_url",
        "openai_base_url",
        "anthropic_base_url",
    }
