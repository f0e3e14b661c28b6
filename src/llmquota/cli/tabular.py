"""Rendering rows for people and programs: an aligned table, CSV or JSON.

Values are written exactly as the database returned them: a numeric stays a
decimal string (never a float) in every format, so a cost reads the same in
the terminal, in a spreadsheet and in a JSON consumer.
"""

from __future__ import annotations

import csv
import io
import json
import uuid
from collections.abc import Sequence
from datetime import date, datetime
from decimal import Decimal
from typing import Any, Literal

Format = Literal["table", "csv", "json"]
FORMATS: tuple[Format, ...] = ("table", "csv", "json")


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


def render(columns: Sequence[str], rows: Sequence[Sequence[Any]], fmt: Format) -> str:
    """The rows in one of FORMATS; an empty result still shows its columns."""
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows([cell(v) for v in row] for row in rows)
        return out.getvalue()
    if fmt == "json":
        objects = [dict(zip(columns, map(json_value, row), strict=True)) for row in rows]
        return json.dumps(objects, indent=2) + "\n"
    return _table(columns, rows)


def _table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    texts = [[cell(v) for v in row] for row in rows]
    widths = [len(c) for c in columns]
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

    lines = [line(columns), "  ".join("-" * w for w in widths)]
    lines += [line(row) for row in texts]
    lines.append(f"({len(rows)} row{'' if len(rows) == 1 else 's'})")
    return "\n".join(lines) + "\n"
