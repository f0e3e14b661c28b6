"""`llmquota config`, the real command as a subprocess: effective values, secrets masked."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.unit.test_readme_configuration import readme_rows

LLMQUOTA = [sys.executable, "-m", "llmquota.cli"]

SECRETS = {
    "LLMQUOTA_ADMIN_KEY": "lq_admin-0f1e2d3c4b5a6978",
    "LLMQUOTA_METRICS_TOKEN": "scrape-me-0123456789abcdef",
    "LLMQUOTA_OPENAI_API_KEY": "sk-openai-fedcba9876543210",
    "LLMQUOTA_ANTHROPIC_API_KEY": "sk-ant-a1b2c3d4e5f6a7b8",
}
DB_PASSWORD = "pg-pass-7a6b5c4d"


def _config(*args: str, **variables: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMQUOTA_")}
    env.update(variables)
    result = subprocess.run(
        [*LLMQUOTA, "config", *args], env=env, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    return result.stdout


def _with_secrets() -> dict[str, str]:
    return {
        **SECRETS,
        "LLMQUOTA_DATABASE_URL": f"postgresql://llmquota:{DB_PASSWORD}@db.internal:5432/llmquota",
        "LLMQUOTA_LISTEN_DATABASE_URL": f"postgresql://db.internal/llmquota?password={DB_PASSWORD}",
        "LLMQUOTA_OPENAI_BASE_URL": "https://api.openai.com/v1",
        "LLMQUOTA_ANTHROPIC_BASE_URL": "https://api.anthropic.com",
        "LLMQUOTA_POOL_MAX_SIZE": "37",
        "LLMQUOTA_PORT": "9191",
    }


def test_config_masks_every_secret_and_shows_what_the_environment_set() -> None:
    output = _config(**_with_secrets())
    for secret in [*SECRETS.values(), DB_PASSWORD]:
        assert secret not in output
    lines = set(output.splitlines())
    for variable in SECRETS:
        assert f"{variable}=***" in lines
    assert "LLMQUOTA_DATABASE_URL=postgresql://llmquota:***@db.internal:5432/llmquota" in lines
    assert "LLMQUOTA_LISTEN_DATABASE_URL=postgresql://db.internal/llmquota?password=***" in lines
    assert "LLMQUOTA_OPENAI_BASE_URL=https://api.openai.com/v1" in lines
    assert "LLMQUOTA_POOL_MAX_SIZE=37" in lines  # set: the environment's value
    assert "LLMQUOTA_POOL_MIN_SIZE=2" in lines  # unset: the default
    assert "LLMQUOTA_PORT=9191" in lines  # a command flag's variable
    assert "# LLMQUOTA_DATA_DIR unset" in lines


def test_config_json_is_masked_too_and_grouped_like_the_readme() -> None:
    output = _config("--json", **_with_secrets())
    for secret in [*SECRETS.values(), DB_PASSWORD]:
        assert secret not in output
    topics = json.loads(output)
    assert topics["Database"]["LLMQUOTA_POOL_MAX_SIZE"] == "37"
    assert topics["Authentication"]["LLMQUOTA_ADMIN_KEY"] == "***"
    assert topics["Database"]["LLMQUOTA_DATA_DIR"] is None
    readme_topics = list(dict.fromkeys(topic for topic, *_ in readme_rows()))
    assert list(topics) == readme_topics
    assert sum(len(v) for v in topics.values()) == len(readme_rows()) == 133


def test_config_in_a_clean_environment_prints_the_readme_defaults() -> None:
    printed = {}
    for line in _config().splitlines():
        if line.startswith("LLMQUOTA_"):
            name, _, value = line.partition("=")
            printed[name] = f"`{value}`" if value else "empty"
        elif line.startswith("# LLMQUOTA_"):
            printed[line.split()[1]] = "unset"
    documented = {variable: default for _t, variable, default, _m in readme_rows()}
    assert printed == documented
    assert len(printed) == 133


def test_config_refuses_an_invalid_setting_without_echoing_it() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMQUOTA_")}
    env["LLMQUOTA_POOL_MAX_SIZE"] = "lots-of-them-0xdeadbeef"
    result = subprocess.run(
        [*LLMQUOTA, "config"], env=env, capture_output=True, text=True, check=False
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert "invalid configuration" in result.stderr
    assert "0xdeadbeef" not in result.stderr
