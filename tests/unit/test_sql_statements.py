"""store/sqlfiles.py's sql_statements: a script split where PostgreSQL ends
its statements, never inside a string, an identifier, a comment or a body.

The migrations run one statement at a time through it (Citus refuses a
CREATE INDEX on a distributed table sent with other commands), so a wrong
split would break a revision: these cases are the SQL the migrations write.
"""

from __future__ import annotations

import re

import pytest

from llmquota.resources import migrations_dir
from llmquota.store.sqlfiles import sql_statements


def test_a_script_is_split_at_each_semicolon_between_statements() -> None:
    script = "CREATE TABLE a (x int);\nCREATE INDEX a_x ON a (x);\n\n-- done\n"
    assert sql_statements(script) == [
        "CREATE TABLE a (x int)",
        "CREATE INDEX a_x ON a (x)",
    ]


@pytest.mark.parametrize(
    "statement",
    [
        "SELECT 'a;b', 'it''s; here'",
        "SELECT E'\\';', e'x\\\\'",
        'SELECT 1 AS "odd;name", 2 AS "quote "" ; inside"',
        "SELECT 1 -- a comment; with 'a quote\n",
        "SELECT /* a ; /* nested ; */ still ; */ 1",
        "CREATE FUNCTION f() RETURNS int LANGUAGE sql AS $$ SELECT 1; SELECT 2 $$",
        "DO $body$ BEGIN PERFORM 1; RAISE NOTICE '$$;'; END $body$",
        "CREATE FUNCTION g() RETURNS text LANGUAGE plpgsql AS $f$\nBEGIN\n"
        "    RETURN $q$;$q$;\nEND\n$f$",
        "SELECT a$b$c, $1 FROM t",
    ],
)
def test_a_semicolon_inside_a_string_identifier_comment_or_body_ends_nothing(
    statement: str,
) -> None:
    assert sql_statements(f"{statement};\nSELECT 3;") == [statement.strip(), "SELECT 3"]


def test_a_sql_standard_routine_body_ends_at_the_semicolon_after_its_end() -> None:
    # BEGIN ATOMIC ... END holds statements of its own, as psql reads it; a
    # CASE ... END inside it closes nothing; BEGIN and END elsewhere are words.
    function = (
        "CREATE OR REPLACE FUNCTION f(x int) RETURNS int LANGUAGE sql\nBEGIN ATOMIC\n"
        "    INSERT INTO t VALUES (x);\n"
        "    SELECT CASE WHEN x > 0 THEN 1 ELSE 0 END;\nEND"
    )
    procedure = "-- a comment first\ncreate procedure p() begin atomic select 1; end"
    script = f"{function};\nBEGIN;\n{procedure};\nSELECT 1 AS \"end\", 'begin;';\nEND;\n"
    assert sql_statements(script) == [
        function,
        "BEGIN",
        procedure,
        "SELECT 1 AS \"end\", 'begin;'",
        "END",
    ]
    sql_body = "CREATE FUNCTION g(x int) RETURNS int LANGUAGE sql RETURN CASE x WHEN 1 THEN 2 END"
    assert sql_statements(f"{sql_body};\nSELECT 3;") == [sql_body, "SELECT 3"]


def test_every_migration_script_splits_into_statements_that_each_start_with_sql() -> None:
    # Each piece of every revision's scripts starts with a keyword (or a
    # comment before one), never in the middle of a body or a string.
    starts = re.compile(
        r"(--[^\n]*\n\s*)*(CREATE|DROP|ALTER|COMMENT|INSERT|UPDATE|DELETE|DO|GRANT|REVOKE|"
        r"SELECT|WITH|SET|TRUNCATE|LOCK|ANALYZE|REFRESH|--)\b",
        re.IGNORECASE,
    )
    scripts = 0
    for path in sorted((migrations_dir() / "versions").glob("*.py")):
        for script in re.findall(r'r"""(.*?)"""', path.read_text(encoding="utf-8"), re.DOTALL):
            scripts += 1
            for statement in sql_statements(script):
                assert starts.match(statement), (path.name, statement[:120])
    assert scripts >= 50


def test_a_long_run_of_blank_lines_and_comments_is_read_once() -> None:
    # A first version told code from comments with a regex that backtracked
    # without end on a long blank run before code: a downgrade hung in it.
    blank = "\n" * 5_000 + "  -- a note\n" + " " * 5_000
    assert sql_statements(f"{blank}SELECT 1;{blank}") == ["-- a note\n" + " " * 5_000 + "SELECT 1"]
