"""Rendering rows for people and programs: an aligned table, CSV or JSON.

Values are written exactly as the database returned them: a numeric stays a
decimal string (never a float) in every format, so a cost reads the same in
the terminal, in a spreadsheet and in a JSON consumer.

Text is not trusted, whatever the input checks say today: ledger rows
written before llmquota.domain.names existed may hold any name. So a CSV
cell of text that a spreadsheet would run as a formula (OWASP's rule: it
starts with `=`, `+`, `-`, `@`, a tab or a CR) is prefixed with `'`, and a
cell holding a CR or LF is quoted, so it cannot end a row; a table shows
control characters as escapes (`\n`, `\x1b`), so a name cannot forge a line
or drive the terminal. Numbers are typed by the database and left as they
are: a refund of -0.01 stays a number. JSON escapes on its own.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from datetime import date, datetime
from decimal import Decimal
from typing import Any, Literal

Format = Literal["table", "csv", "json"]
FORMATS: tuple[Format, ...] = ("table", "csv", "json")

# What a spreadsheet takes for the start of a formula (OWASP, "CSV Injection").
FORMULA_LEADS = ("=", "+", "-", "@", "\t", "\r")
# What a CSV cell is quoted for (RFC 4180), CR included: a bare CR ends a row
# in many readers, and Python's csv module quotes only its line terminator.
_CSV_SPECIAL = re.compile(r'[",\r\n]')
# What a table shows escaped: C0 and C1 controls and DEL (newlines, ESC and
# the rest of the terminal's control sequences), the Unicode line and
# paragraph separators, and the bidirectional overrides that reorder a line.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_NAMED_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def cell(value: Any) -> str:
    """A value as text: '' for NULL, ISO for times, decimals as written."""
    if value is None:
        return ""
    if isinstance(value, datetime | date):
        return value.isoformat()
    return str(value)


def json_value(value: Any) -> Any:
    """A value for JSON: decimals and times as strings, numbers and text as is."""
    if isinstance(value, Decimal | datetime | date | uuid.UUID):
        return cell(value)
    return value


def csv_cell(value: Any) -> str:
    """A value as one CSV field: text that could start a formula neutralised, and
    quoted when it holds a quote, a comma, a CR or an LF."""
    text = cell(value)
    if not _is_number(value) and text.startswith(FORMULA_LEADS):
        text = "'" + text
    if _CSV_SPECIAL.search(text):
        text = '"' + text.replace('"', '""') + '"'
    return text


def table_cell(value: Any) -> str:
    """A value as a table shows it: control characters as visible escapes."""
    return _CONTROL.sub(_escape, cell(value))


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    named = _NAMED_ESCAPES.get(char)
    if named is not None:
        return named
    code = ord(char)
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float | Decimal) and not isinstance(value, bool)


def render(columns: Sequence[str], rows: Sequence[Sequence[Any]], fmt: Format) -> str:
    """The rows in one of FORMATS; an empty result still shows its columns."""
    if fmt == "csv":
        # A row of one empty cell is written "" (as the csv module does): an
        # empty line is no row at all to a reader.
        lines = [",".join(csv_cell(v) for v in row) or '""' for row in [columns, *rows]]
        return "".join(line + "\n" for line in lines)
    if fmt == "json":
        objects = [dict(zip(columns, map(json_value, row), strict=True)) for row in rows]
        return json.dumps(objects, indent=2) + "\n"
    return _table(columns, rows)


def _table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    texts = [[table_cell(v) for v in row] for row in rows]
    headers = [table_cell(c) for c in columns]
    widths = [len(c) for c in headers]
    for row in texts:
        widths = [max(w, len(t)) for w, t in zip(widths, row, strict=True)]
    numeric = [
        all(isinstance(row[i], int | Decimal) or row[i] is None for row in rows) and bool(rows)
        for i in range(len(columns))
    ]

    def line(values: Sequence[str]) -> str:
        parts = [
            v.rjust(w) if right else v.ljust(w)
            for v, w, right in zip(values, widths, numeric, strict=True)
        ]
        return "  ".join(parts).rstrip()

    lines = [line(headers), "  ".join("-" * w for w in widths)]
    lines += [line(row) for row in texts]
    lines.append(f"({len(rows)} row{'' if len(rows) == 1 else 's'})")
    return "\n".join(lines) + "\n"
