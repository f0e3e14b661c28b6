"""The name and model patterns (domain.names) and the CLI's output escaping
(cli.tabular), case by case: what each accepts, what each turns hostile
text into."""

from __future__ import annotations

import csv
import io
from datetime import date
from decimal import Decimal

import pytest

from llmquota.cli.tabular import csv_cell, render, table_cell
from llmquota.domain.errors import InvalidRequest
from llmquota.domain.names import (
    MODEL_MAX_CHARS,
    NAME_MAX_CHARS,
    is_model,
    is_model_glob,
    is_name,
)
from llmquota.domain.validation import check_model, check_model_glob, check_name

GOOD_NAMES = ["acme", "a", "A-b_c.d", "-x", "_x", "a..b", "x.", "9" * NAME_MAX_CHARS]
BAD_NAMES = [
    "",
    ".",
    "..",
    ".x",
    "a" * (NAME_MAX_CHARS + 1),
    "a/b",
    "a\\b",
    "a b",
    "a:b",
    "a\n",
    "acme\nforged",
    "a\x1b[2J",
    "a\x00",
    "acmé",
    "\uff41\uff43\uff4d\uff45",  # fullwidth "acme": letters, but not ASCII ones
    5,
    None,
]
GOOD_MODELS = [
    "gpt-4o",
    "gpt-4o-2024-08-06",
    "ft:gpt-4o-mini:org::abc123",
    "meta-llama/Llama-3-8b",
    "claude-3-5-sonnet@20240620",
    "m" * MODEL_MAX_CHARS,
]
BAD_MODELS = [
    "",
    "m" * (MODEL_MAX_CHARS + 1),
    "gpt 4o",
    "gpt-4o\n",
    "gpt-4o\r",
    "gpt-4o\t",
    "gpt-4o\x1b[2J",
    "gpt-4o\x00",
    "gpt-4o\u202e",
    '=HYPERLINK("http://x","y")',
    "gpt-4ö",
    "gpt-4o*",
    None,
]


@pytest.mark.parametrize("name", GOOD_NAMES)
def test_names_the_pattern_accepts(name: str) -> None:
    assert is_name(name)
    assert check_name("tenant", name) == name


@pytest.mark.parametrize("name", BAD_NAMES)
def test_names_the_pattern_refuses_with_the_field_named(name: object) -> None:
    assert not is_name(name)
    with pytest.raises(InvalidRequest, match=r"^route must be ASCII letters, digits, '-', '_'"):
        check_name("route", name)


@pytest.mark.parametrize("model", GOOD_MODELS)
def test_models_the_pattern_accepts(model: str) -> None:
    assert is_model(model) and is_model_glob(model)
    assert check_model(model) == model


@pytest.mark.parametrize("model", BAD_MODELS)
def test_models_the_pattern_refuses(model: object) -> None:
    assert not is_model(model)
    with pytest.raises(InvalidRequest, match=r"^fallback_models must be ASCII letters"):
        check_model(model, "fallback_models")


def test_globs_add_only_the_star() -> None:
    assert check_model_glob("gpt-4o-2024-*") == "gpt-4o-2024-*"
    assert check_model_glob("*") == "*"
    for glob in ("gpt 4o*", "gpt-4o*\n", "gpt-4o?", "gpt-[4]o", "g" * (MODEL_MAX_CHARS + 1)):
        with pytest.raises(InvalidRequest, match=r"^models must be .* or '\*' globs"):
            check_model_glob(glob)


# Each hostile text as CSV must read back with a leading ' (formula leads)
# or as itself (inside a quoted cell), one row per row.
HOSTILE = {
    '=HYPERLINK("http://evil","x")': '\'=HYPERLINK("http://evil","x")',
    "@SUM(1+1)*cmd|' /C calc'!A0": "'@SUM(1+1)*cmd|' /C calc'!A0",
    "+1+1": "'+1+1",
    "-1+1": "'-1+1",
    "\tname": "'\tname",
    "\rname": "'\rname",
    "a\rb": "a\rb",
    "a\nforged,row": "a\nforged,row",
    'say "hi"': 'say "hi"',
    "\x1b[2Jclear": "\x1b[2Jclear",
    "plain": "plain",
}


def test_csv_neutralises_formula_leads_and_quotes_cr_and_lf() -> None:
    rows = [(text, 1) for text in HOSTILE]
    out = render(("model", "requests"), rows, "csv")
    # A bare CR or LF appears only inside a quoted cell: every row ends in ",1\n".
    assert out.count("\n") == len(HOSTILE) + 1 + 1  # rows, header, the LF inside a cell
    parsed = list(csv.reader(io.StringIO(out, newline="")))
    assert parsed[0] == ["model", "requests"]
    assert [row[0] for row in parsed[1:]] == list(HOSTILE.values())
    assert [row[1] for row in parsed[1:]] == ["1"] * len(HOSTILE)
    assert csv_cell("\rname") == '"\'\rname"'
    assert csv_cell("a\rb") == '"a\rb"'


def test_csv_leaves_numbers_dates_and_nulls_as_they_are() -> None:
    values = [Decimal("-0.01"), -5, 0, date(2025, 3, 1), None, True]
    assert [csv_cell(v) for v in values] == ["-0.01", "-5", "0", "2025-03-01", "", "True"]
    # Text that only looks like a negative number is still text, and neutralised.
    assert csv_cell("-0.01") == "'-0.01"
    # A row of one empty cell stays a row.
    assert render(("route",), [(None,)], "csv") == 'route\n""\n'


def test_table_escapes_control_characters() -> None:
    assert table_cell("a\nforged") == "a\\nforged"
    assert table_cell("x\x1b[2J") == "x\\x1b[2J"
    assert table_cell("\r\t\x00\x7f\x9b") == "\\r\\t\\x00\\x7f\\x9b"
    assert table_cell("evil\u202etxt.exe\u2028") == "evil\\u202etxt.exe\\u2028"
    assert table_cell("Zürich 数据") == "Zürich 数据"  # printable text stays as it is
    rows = [("a\nforged  line", 1), ("\x1b[2J", 2)]
    lines = render(("model", "n"), rows, "table").splitlines()
    # One line per row, the widths those of the escaped text.
    assert lines == [
        "model            n",
        "---------------  -",
        "a\\nforged  line  1",
        "\\x1b[2J          2",
        "(2 rows)",
    ]


def test_json_escapes_on_its_own() -> None:
    out = render(("model",), [("a\nb\x1b",)], "json")
    assert "\x1b" not in out and "\\u001b" in out
    assert len(out.splitlines()) == 5  # [ { "model": ... } ]: the value's newline escaped
