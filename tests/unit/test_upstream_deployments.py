"""Several deployments of one model in LLMQUOTA_UPSTREAMS_FILE: the [[routing]]
rule that ranks them (`order`, `cheapest` by `price_factor`), and its mistakes
refused at start-up with the file and the field named."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest

from llmquota.config import Settings
from llmquota.config.upstreams import deployments

SECRET = "sk-never-print-this-0123"

TWO = """
[[upstream]]
name = "openai"
format = "openai"
base_url = "https://api.openai.com/v1"
api_key_env = "LQ_TEST_DEPLOY_KEY"
models = ["gpt-4o", "gpt-4o-*"]

[[upstream]]
name = "azure"
format = "openai"
base_url = "https://acme.openai.azure.com/openai/v1"
api_key_env = "LQ_TEST_DEPLOY_KEY"
price_factor = 0.8
models = ["gpt-4o*"]

[[upstream]]
name = "azure-eu"
format = "openai"
base_url = "https://acme-eu.openai.azure.com/openai/v1"
api_key_env = "LQ_TEST_DEPLOY_KEY"
price_factor = 0.8
models = ["gpt-4o"]
"""


@pytest.fixture(autouse=True)
def key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LQ_TEST_DEPLOY_KEY", SECRET)


def load(tmp_path: Path, text: str) -> Settings:
    path = tmp_path / "upstreams.toml"
    path.write_text(text)
    return Settings(_env_file=None, upstreams_file=str(path))  # type: ignore[call-arg]


def ranked(settings: Settings, model: str) -> list[str]:
    found = deployments(settings.upstreams(), "openai", model, settings.routing())
    return [u.name for u in found]


def test_order_is_the_default_exact_names_first_then_globs_in_file_order(
    tmp_path: Path,
) -> None:
    settings = load(tmp_path, TWO)
    assert settings.routing() == ()
    assert ranked(settings, "gpt-4o") == ["openai", "azure-eu", "azure"]
    assert ranked(settings, "gpt-4o-mini") == ["openai", "azure"]
    assert ranked(settings, "o3") == []


def test_cheapest_ranks_by_price_factor_ties_in_order_and_only_for_its_models(
    tmp_path: Path,
) -> None:
    rules = '\n[[routing]]\nmodels = ["gpt-4o"]\nrule = "cheapest"\n'
    rules += '\n[[routing]]\nmodels = ["gpt-*"]\nrule = "order"\n'
    settings = load(tmp_path, TWO + rules)
    assert ranked(settings, "gpt-4o") == ["azure-eu", "azure", "openai"]
    # The first rule that matches wins: gpt-4o-mini is ranked by `order`.
    assert ranked(settings, "gpt-4o-mini") == ["openai", "azure"]
    assert [u.price_factor for u in settings.upstreams()] == [1.0, 0.8, 0.8]


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ('\n[[routing]]\nmodels = ["gpt-4o"]\nrule = "fastest"\n', "routing[0].rule: must be"),
        ('\n[[routing]]\nrule = "cheapest"\n', "routing[0].models: must be a list"),
        ('\n[[routing]]\nmodels = ["x"]\nrule = "order"\nweight = 2\n', "routing[0].weight"),
        ('\nrouting = "cheapest"\n', "routing must be [[routing]] tables"),
        ("\n[[route]]\nmodels = []\n", "unknown table 'route'; use [[upstream]] or [[routing]]"),
    ],
)
def test_a_bad_routing_table_fails_at_start_up_naming_the_field(
    tmp_path: Path, extra: str, says: str
) -> None:
    # A top-level key must come before the first table to stay top-level in TOML.
    text = extra + TWO if extra.startswith("\nrouting =") else TWO + extra
    with pytest.raises(pydantic.ValidationError) as refused:
        load(tmp_path, text)
    assert says in str(refused.value) and SECRET not in str(refused.value)


@pytest.mark.parametrize("factor", ["0", "-1", "true", '"cheap"', "1e9"])
def test_a_bad_price_factor_is_refused_naming_the_upstream(tmp_path: Path, factor: str) -> None:
    text = TWO.replace("price_factor = 0.8", f"price_factor = {factor}", 1)
    with pytest.raises(pydantic.ValidationError) as refused:
        load(tmp_path, text)
    assert "upstream[1] (azure).price_factor: a number above 0, at most 1000" in str(refused.value)
