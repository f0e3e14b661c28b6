"""LLMQUOTA_UPSTREAMS_FILE: several upstreams and the models each serves, checked
at start-up with the file and the field named, and never a key in a message."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pydantic
import pytest
from pydantic import SecretStr

from llmquota.config import Settings, UpstreamConfig, route

SECRET = "sk-never-print-this-0123"

GOOD = """
[[upstream]]
name = "openai-main"
format = "openai"
base_url = "https://api.openai.com/v1"
api_key_env = "LQ_TEST_OPENAI_KEY"
models = ["gpt-4o", "gpt-4o-*", "o3*"]

[[upstream]]
name = "local"
format = "openai"
base_url = "http://127.0.0.1:9000/v1"
api_key_file = "{key_file}"
connect_timeout_seconds = 2
read_timeout_seconds = 30.5
models = ["llama-*", "gpt-4o-mini"]

[[upstream]]
name = "claude"
format = "anthropic"
base_url = "https://api.anthropic.com"
api_key_env = "LQ_TEST_ANTHROPIC_KEY"
models = ["claude-*"]
"""


def write(tmp_path: Path, text: str) -> Path:
    key_file = tmp_path / "local.key"
    key_file.write_text(SECRET + "\n")
    path = tmp_path / "upstreams.toml"
    path.write_text(text.replace("{key_file}", str(key_file)))
    return path


def load(path: Path, **values: object) -> Settings:
    return Settings(_env_file=None, upstreams_file=str(path), **values)  # type: ignore[call-arg]


@pytest.fixture(autouse=True)
def keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LQ_TEST_OPENAI_KEY", SECRET)
    monkeypatch.setenv("LQ_TEST_ANTHROPIC_KEY", SECRET)


def test_a_good_file_gives_every_upstream_with_its_key_and_timeouts(tmp_path: Path) -> None:
    settings = load(write(tmp_path, GOOD))
    upstreams = {u.name: u for u in settings.upstreams()}
    assert list(upstreams) == ["openai-main", "local", "claude"]
    assert upstreams["local"].api_key.get_secret_value() == SECRET  # the file's, stripped
    assert upstreams["local"].connect_timeout_seconds == 2.0
    assert upstreams["local"].read_timeout_seconds == 30.5
    assert upstreams["openai-main"].read_timeout_seconds is None
    assert SECRET not in repr(settings.upstreams())


def test_models_are_routed_exact_name_first_then_the_first_glob(tmp_path: Path) -> None:
    upstreams = load(write(tmp_path, GOOD)).upstreams()

    def name(form: str, model: str) -> str | None:
        found = route(upstreams, form, model)  # type: ignore[arg-type]
        return None if found is None else found.name

    assert name("openai", "gpt-4o") == "openai-main"
    assert name("openai", "gpt-4o-mini") == "local"  # exact beats openai-main's glob
    assert name("openai", "gpt-4o-2024-08-06") == "openai-main"
    assert name("openai", "llama-3.1-70b") == "local"
    assert name("openai", "o3-mini") == "openai-main"
    assert name("openai", "mistral-large") is None
    assert name("openai", "claude-sonnet-4") is None  # a claude upstream, not of this format
    assert name("anthropic", "claude-sonnet-4") == "claude"


def test_the_simple_variables_still_work_and_serve_every_model_of_their_format(
    tmp_path: Path,
) -> None:
    both = load(
        write(tmp_path, GOOD),
        openai_base_url="http://fallback/v1",
        openai_api_key="sk-fallback",
    ).upstreams()
    assert [u.name for u in both][-1] == "openai"
    fallback = route(both, "openai", "mistral-large")
    assert fallback is not None and fallback.base_url == "http://fallback/v1"
    exact = route(both, "openai", "gpt-4o")
    assert exact is not None and exact.name == "openai-main"  # the file's routing first
    alone = Settings(  # type: ignore[call-arg]
        _env_file=None, anthropic_base_url="http://a", anthropic_api_key="k"
    ).upstreams()
    assert [(u.name, u.format, u.models) for u in alone] == [("anthropic", "anthropic", ("*",))]


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (('format = "openai"', 'format = "gemini"', 1), "upstream[0] (openai-main).format"),
        (('name = "local"', 'name = ""', 1), "upstream[1].name: required"),
        (('models = ["claude-*"]', "models = []", 1), "upstream[2] (claude).models"),
        (("read_timeout_seconds = 30.5", "read_timeout_seconds = -1", 1), "read_timeout_seconds"),
        (("read_timeout_seconds = 30.5", "read_timout_seconds = 3", 1), "read_timout_seconds"),
        (('base_url = "https://api.anthropic.com"', 'base_url = "api"', 1), "(claude).base_url"),
        (("LQ_TEST_ANTHROPIC_KEY", "LQ_TEST_UNSET_KEY", 1), "LQ_TEST_UNSET_KEY is not set"),
        (('api_key_file = "', 'api_key_file = "/nonexistent', 1), "(local).api_key_file"),
        (('name = "claude"', 'name = "local"', 1), "'local' is used twice"),
        (("[[upstream]]", "[[upstreams]]", 3), "unknown table 'upstreams'"),
        (("models = [", "models = ", 1), "not valid TOML"),
        (
            ('api_key_env = "LQ_TEST_OPENAI_KEY"', 'api_key_env = "X"\napi_key_file = "y"', 1),
            "(openai-main): give exactly one of api_key_env or api_key_file",
        ),
    ],
)
def test_a_bad_file_fails_at_start_up_naming_the_file_and_the_field(
    tmp_path: Path, change: tuple[str, str, int], says: str
) -> None:
    old, new, count = change
    path = write(tmp_path, GOOD.replace(old, new, count))
    with pytest.raises(pydantic.ValidationError) as refused:
        load(path)
    message = str(refused.value)
    assert str(path) in message and says in message
    assert SECRET not in message


def test_a_missing_file_names_itself(tmp_path: Path) -> None:
    with pytest.raises(pydantic.ValidationError) as refused:
        load(tmp_path / "nope.toml")
    assert f"{tmp_path / 'nope.toml'}: cannot be read" in str(refused.value)


def test_the_command_stops_with_a_clear_message_and_no_traceback(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD.replace('format = "openai"', 'format = "gemini"', 1))
    env = {"PATH": "/usr/bin:/bin", "LLMQUOTA_UPSTREAMS_FILE": str(path)}
    env["LQ_TEST_OPENAI_KEY"] = env["LQ_TEST_ANTHROPIC_KEY"] = SECRET
    result = subprocess.run(
        [sys.executable, "-m", "llmquota.cli", "serve"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert f"invalid configuration: {path}: upstream[0] (openai-main).format" in result.stderr
    assert "Traceback" not in result.stderr and SECRET not in result.stderr + result.stdout


def test_only_star_is_a_wildcard_in_model_patterns() -> None:
    config = UpstreamConfig(
        "x", "openai", "http://x/v1", SecretStr("k"), ("ft:gpt-4o:[acme]*", "o3*")
    )
    assert config.serves("ft:gpt-4o:[acme]:run-7") == "glob"
    assert config.serves("ft:gpt-4o:a:run-7") is None  # [acme] is not a character class
    assert config.serves("o3") == "glob" and config.serves("gpt-o3") is None
