"""Loading the hand-written SQL in `sql/`.

`queries.sql` holds named blocks in procrastinate's style:

    -- name_of_query --
    -- One line saying what it does.
    SELECT ...;

They are split once at import into a dict; a test checks every name the
store uses exists. `finance_queries.sql` holds the ledger's finance side in
the same form.

The other files are the repeatable scripts: the code of the database
(functions, views, grants), which `llmquota migrate` re-applies after the
versioned migrations whenever a file differs from the one the database last
ran (see migrations/README.md). `repeatable_scripts()` lists them in the order
they are applied.
"""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

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


# The repeatable scripts, in the order they are applied: the admission
# functions, the allotments' (which call admission's), the plans' and
# ceilings' (which call lq_refilled), the global layer's shards
# (lq_put_global and the global_layer view), the learned output estimates'
# (which lq_finish calls), the ledger's,
# the reliability functions (which call lq_lock_idempotency_keys of
# admission.sql), the quota, credit and alert helpers (which admission and
# settlement call in their own transaction), the keys' revocation, the
# response cache's (which writes ledger rows, so after ledger.sql), the
# reporting schema (the base views first), and last the grants, which cover
# every function and view the scripts before them define.
REPEATABLE_SCRIPTS = (
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
    "reports/*.sql",
    "roles.sql",
)

# Grants are re-applied whenever any script before them was: a function that
# is new (or dropped and re-created) has PostgreSQL's default privileges, not
# the ones roles.sql gives.
FOLLOWS_EVERY_CHANGE = frozenset({"roles.sql"})


@dataclass(frozen=True)
class RepeatableScript:
    """One repeatable script: its name under sql/, its text and its checksum."""

    name: str
    text: str
    checksum: str
    follows_every_change: bool = False


def repeatable_scripts(root: Path | None = None) -> list[RepeatableScript]:
    """The repeatable scripts of `root` (default: sql/), in the order they are applied.

    The checksum is the SHA-256 of the file's bytes, as `sha256sum` prints it.
    """
    base = sql_dir() if root is None else root
    scripts: list[RepeatableScript] = []
    for pattern in REPEATABLE_SCRIPTS:
        paths = sorted(base.glob(pattern)) if "*" in pattern else [base / pattern]
        for path in paths:
            data = path.read_bytes()
            name = path.relative_to(base).as_posix()
            scripts.append(
                RepeatableScript(
                    name=name,
                    text=data.decode("utf-8"),
                    checksum=hashlib.sha256(data).hexdigest(),
                    follows_every_change=name in FOLLOWS_EVERY_CHANGE,
                )
            )
    return scripts


# What the statement splitter stops at: a semicolon, or the start of
# something a semicolon inside does not end (a comment, a string, a quoted
# identifier, a dollar-quoted body), or a word that opens or closes a
# SQL-standard routine body (BEGIN ATOMIC ... END, and CASE ... END inside it).
_SPLIT_AT = re.compile(
    r";|--|/\*|\"|(?<![\w$])[Ee]'|'|(?<![\w$])\$(?:[A-Za-z_\x80-\uffff][\w\x80-\uffff]*)?\$"
    r"|(?<![\w$])(?i:begin|case|end)(?![\w$])"
)
_ROUTINE = re.compile(r"create\s+(?:or\s+replace\s+)?(?:function|procedure)\b", re.IGNORECASE)
_BLOCK_COMMENT = re.compile(r"/\*|\*/")
_SPACE = re.compile(r"\s*")
_STRING_END = re.compile(r"(?:[^']|'')*'")
_ESCAPED_STRING_END = re.compile(r"(?:[^'\\]|''|\\.)*'", re.DOTALL)
_IDENTIFIER_END = re.compile(r'(?:[^"]|"")*"')


def sql_statements(script: str) -> list[str]:
    """The statements of a SQL script, in order, as PostgreSQL's own lexer
    would end them: at a semicolon outside strings, quoted identifiers,
    comments and dollar-quoted bodies.

    Why: on Citus, a CREATE INDEX on a distributed table sent in a
    multi-statement string is passed on to the worker as that whole string,
    which the worker refuses (a cell upgraded in place runs its migrations
    against distributed tables; store/migration_support.py)."""
    statements, start, at = [], 0, 0
    # A CREATE FUNCTION or PROCEDURE with a SQL-standard body (BEGIN ATOMIC)
    # ends at the semicolon after its END, as psql ends it: its depth.
    depth, routine = 0, None
    while (found := _SPLIT_AT.search(script, at)) is not None:
        token, at = found.group(), found.end()
        if token == ";":
            if depth:
                continue
            statements.append(script[start : found.start()])
            start, routine = at, None
        elif token.isalpha():
            if routine is None:
                routine = _ROUTINE.match(script, _code_start(script, start)) is not None
            if routine:
                depth = depth + 1 if token.lower() != "end" else max(0, depth - 1)
        elif token == "--":
            newline = script.find("\n", at)
            at = len(script) if newline < 0 else newline + 1
        elif token == "/*":
            at = _end_of_block_comment(script, at)
        else:
            at = _end_of_quoted(script, token, at)
    statements.append(script[start:])
    return [s.strip() for s in statements if _holds_code(s)]


def _holds_code(fragment: str) -> bool:
    """Whether anything but whitespace and comments is in `fragment`."""
    return _code_start(fragment, 0) < len(fragment)


def _code_start(text: str, at: int) -> int:
    """Where the code begins in `text` from `at`: past whitespace and comments."""
    while True:
        at = _SPACE.match(text, at).end()  # type: ignore[union-attr]  # (\s* always matches)
        if text.startswith("--", at):
            newline = text.find("\n", at)
            at = len(text) if newline < 0 else newline + 1
        elif text.startswith("/*", at):
            at = _end_of_block_comment(text, at + 2)
        else:
            return at


def _end_of_block_comment(script: str, at: int) -> int:
    """Past the `*/` that closes a block comment begun before `at` (they nest)."""
    depth = 1
    while depth and (found := _BLOCK_COMMENT.search(script, at)) is not None:
        depth += 1 if found.group() == "/*" else -1
        at = found.end()
    return at if not depth else len(script)


def _end_of_quoted(script: str, opening: str, at: int) -> int:
    """Past the end of the string, identifier or dollar-quoted body `opening` began."""
    if opening.startswith("$"):
        end = script.find(opening, at)
        return len(script) if end < 0 else end + len(opening)
    closing = {
        '"': _IDENTIFIER_END,
        "'": _STRING_END,
    }.get(opening, _ESCAPED_STRING_END)
    found = closing.match(script, at)
    return len(script) if found is None else found.end()
