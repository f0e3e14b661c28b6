"""Loading the hand-written SQL in `sql/`.

`queries.sql` holds named blocks in procrastinate's style:

    -- name_of_query --
    -- One line saying what it does.
    SELECT ...;

They are split once at import into a dict; a test checks every name the
store uses exists. `finance_queries.sql` holds the ledger's finance side in
the same form. Other files (function definitions, roles, the reports of
sql/reports/) are whole scripts that the migrations execute.
"""

from __future__ import annotations

import functools
import re

from llmquota.resources import sql_dir

_BLOCK_HEADER = re.compile(r"^-- ([a-z_]+) --$", re.MULTILINE)


def parse_queries(text: str) -> dict[str, str]:
    """Split a named-block file into {name: statement}."""
    parts = _BLOCK_HEADER.split(text)
    queries: dict[str, str] = {}
    # parts = [preamble, name1, body1, name2, body2, ...]
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in queries:
            raise ValueError(f"query {name!r} is defined twice")
        statement = body.strip().rstrip(";").strip()
        if not statement:
            raise ValueError(f"query {name!r} is empty")
        queries[name] = statement
    return queries


@functools.cache
def named_queries(filename: str) -> dict[str, str]:
    """The named queries of one file in sql/."""
    return parse_queries((sql_dir() / filename).read_text(encoding="utf-8"))


def queries() -> dict[str, str]:
    """The named queries of sql/queries.sql (the admission service's)."""
    return named_queries("queries.sql")


def script(name: str) -> str:
    """A whole SQL script from sql/, e.g. the admission functions."""
    return (sql_dir() / name).read_text(encoding="utf-8")


def report_scripts() -> list[str]:
    """The scripts of sql/reports/, in file name order (the base views first)."""
    paths = sorted((sql_dir() / "reports").glob("*.sql"))
    return [path.read_text(encoding="utf-8") for path in paths]
