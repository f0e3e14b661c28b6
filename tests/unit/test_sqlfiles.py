"""The named SQL blocks: every name the Store runs exists, and the parser is strict."""

from __future__ import annotations

import ast
import hashlib
import inspect
import re
from pathlib import Path

import pytest

from llmquota.resources import sql_dir
from llmquota.store import (
    admit_statement,
    allotments,
    budget_moves,
    catalog,
    estimates,
    keys,
    outage,
    store,
    tenants,
)
from llmquota.store.sqlfiles import parse_queries, queries, repeatable_scripts, script


def _names_the_store_runs() -> set[str]:
    """String literals passed first to self._fetch(...) or used as self._sql[...]
    in the modules that run queries.sql (the Store, its admit statement, catalog,
    estimates, outage and keys)."""
    tree = ast.parse(_sources())
    names: set[str] = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "_fetch"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names.add(node.args[0].value)
        if (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "_sql"
            and isinstance(node.slice, ast.Constant)
        ):
            names.add(node.slice.value)
    return names


def _sources() -> str:
    modules = (
        store,
        admit_statement,
        allotments,
        budget_moves,
        catalog,
        estimates,
        outage,
        keys,
        tenants,
    )
    return "\n".join(inspect.getsource(module) for module in modules)


def test_the_scan_finds_the_statements_of_every_store_method() -> None:
    # A scan that found nothing would make the next test pass vacuously.
    assert _names_the_store_runs() >= {
        "admit",
        "finish",
        "sweep",
        "heartbeat",
        "put_policy",
        "get_policy",
        "ensure_tenant",
        "tenant_exists",
        "insert_api_key",
        "insert_first_admin_key",
        "find_api_key",
        "layer_status",
        "tenant_usage",
        "purge_finished",
        "put_plan",
        "put_ceiling",
        "output_histograms",
    }


def test_every_name_the_store_runs_exists_in_queries_sql() -> None:
    missing = _names_the_store_runs() - set(queries())
    assert missing == set()


def test_the_ast_scan_agrees_with_a_plain_grep() -> None:
    source = _sources()
    grepped = set(re.findall(r'_fetch\(\s*"([a-z_]+)"', source))
    grepped |= set(re.findall(r'_sql\["([a-z_]+)"\]', source))
    assert grepped == _names_the_store_runs()


def test_no_query_in_queries_sql_is_unused() -> None:
    assert set(queries()) - _names_the_store_runs() == set()


def test_every_query_has_a_comment_and_one_statement() -> None:
    text = (sql_dir() / "queries.sql").read_text(encoding="utf-8")
    blocks = re.split(r"^-- [a-z_]+ --$", text, flags=re.MULTILINE)[1:]
    assert len(blocks) == len(queries()) >= 14
    for block in blocks:
        assert block.strip().startswith("-- ")
    for name, statement in queries().items():
        assert not statement.endswith(";"), name
        assert ";\n" not in statement, name


def test_queries_call_the_admission_functions() -> None:
    q = queries()
    assert "lq_admit(" in q["admit"]
    assert "lq_finish(" in q["finish"]
    assert "lq_sweep(" in q["sweep"]
    functions = script("admission.sql")
    for name in ("lq_refilled", "lq_credit_layers", "lq_admit", "lq_finish", "lq_sweep"):
        assert f"CREATE OR REPLACE FUNCTION {name}(" in functions
    assert "PERFORM lq_record_output_samples(" in functions
    assert "CREATE OR REPLACE FUNCTION lq_record_output_samples(" in script("estimates.sql")


def test_parse_queries_splits_named_blocks() -> None:
    text = "-- preamble\n\n-- one --\n-- first\nSELECT 1;\n\n-- two --\n-- second\nSELECT $1::int\n"
    assert parse_queries(text) == {"one": "-- first\nSELECT 1", "two": "-- second\nSELECT $1::int"}


def test_parse_queries_rejects_duplicate_names() -> None:
    text = "-- one --\nSELECT 1\n-- one --\nSELECT 2\n"
    with pytest.raises(ValueError, match="'one' is defined twice"):
        parse_queries(text)


@pytest.mark.parametrize("body", ["", "\n\n", "  ;  \n", ";"])
def test_parse_queries_rejects_empty_blocks(body: str) -> None:
    with pytest.raises(ValueError, match="'empty' is empty"):
        parse_queries(f"-- ok --\nSELECT 1\n-- empty --\n{body}")


def test_parse_queries_of_a_file_without_blocks_is_empty() -> None:
    assert parse_queries("-- just a comment\nSELECT 1\n") == {}


def test_headers_must_be_whole_lines() -> None:
    # "-- name --" inside a statement line is not a header.
    text = "-- one --\nSELECT 1 -- two --\n"
    assert parse_queries(text) == {"one": "SELECT 1 -- two --"}


def test_every_script_in_sql_is_named_queries_or_repeatable() -> None:
    # A new file in sql/ is either read by the code (named queries) or
    # applied by `llmquota migrate`; it cannot be silently neither.
    named = {
        "queries.sql",
        "finance_queries.sql",
        "alerts_queries.sql",
        "console_queries.sql",
        "cache_queries.sql",
        "cells_queries.sql",
    }
    every = {path.relative_to(sql_dir()).as_posix() for path in sql_dir().rglob("*.sql")}
    assert every - named == {s.name for s in repeatable_scripts()}


def test_repeatable_scripts_of_another_root(tmp_path: Path) -> None:
    (tmp_path / "reports").mkdir()
    names = (
        "admission.sql",
        "allotments.sql",
        "plans.sql",
        "global_layer.sql",
        "estimates.sql",
        "ledger.sql",
        "reliability.sql",
        "quotas.sql",
        "keys.sql",
        "cache.sql",
    )
    for name in (*names, "roles.sql"):
        (tmp_path / name).write_text(f"-- {name}\n", encoding="utf-8")
    (tmp_path / "reports" / "10_b.sql").write_text("SELECT 2;\n", encoding="utf-8")
    (tmp_path / "reports" / "00_a.sql").write_text("SELECT 1;\n", encoding="utf-8")
    scripts = repeatable_scripts(tmp_path)
    assert [s.name for s in scripts] == [
        "admission.sql",
        "allotments.sql",
        "plans.sql",
        "global_layer.sql",
        "estimates.sql",
        "ledger.sql",
        "reliability.sql",
        "quotas.sql",
        "keys.sql",
        "cache.sql",
        "reports/00_a.sql",
        "reports/10_b.sql",
        "roles.sql",
    ]
    assert scripts[10].text == "SELECT 1;\n"
    assert scripts[10].checksum == hashlib.sha256(b"SELECT 1;\n").hexdigest()
