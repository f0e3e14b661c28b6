"""Finance reports: the functions of the `reporting` schema, run by name.

The reports are SQL (sql/reports/), usable as is from psql or a BI tool;
this module only finds them in the database catalog, validates a period and
runs one. What exists is whatever the database has: `--list` reads the
catalog, and a name is run only if the catalog lists it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import date
from typing import Any

from llmquota.domain.errors import InvalidRequest, UnknownReport
from llmquota.domain.validation import check_name
from llmquota.store.connection import Connection, Row, translate_errors
from llmquota.store.sqlfiles import named_queries

# A period longer than this is a typo (or a report that would run for hours).
MAX_REPORT_DAYS = 3_660

# ASCII digits only (`\d` takes any script's digits), the whole text.
_DATE = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")
# What a report function's name may look like before it is quoted into SQL.
_REPORT_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


@dataclass(frozen=True, slots=True)
class Report:
    """A report function: its name, what it shows, and its columns."""

    name: str
    description: str
    columns: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ReportResult:
    """A report's columns and rows (rows as tuples, in column order)."""

    name: str
    columns: tuple[str, ...]
    rows: list[tuple[Any, ...]]


def parse_day(flag: str, text: str | None) -> date:
    """A YYYY-MM-DD calendar date, or InvalidRequest naming the flag."""
    if text is None:
        raise InvalidRequest(f"{flag} is required (YYYY-MM-DD)")
    try:
        if not _DATE.fullmatch(text):
            raise ValueError(text)
        return date.fromisoformat(text)
    except ValueError:
        raise InvalidRequest(f"{flag} must be a date as YYYY-MM-DD, not {text!r}") from None


def parse_period(from_text: str | None, to_text: str | None) -> tuple[date, date]:
    """The half-open period [from, to) in UTC days, validated."""
    start = parse_day("--from", from_text)
    end = parse_day("--to", to_text)
    if end <= start:
        raise InvalidRequest(f"--to ({end}) must be after --from ({start}); --to is exclusive")
    if (end - start).days > MAX_REPORT_DAYS:
        raise InvalidRequest(f"a report covers at most {MAX_REPORT_DAYS} days")
    return start, end


def normalize_name(name: str) -> str:
    """Report names are the SQL function names; dashes are accepted for underscores."""
    return name.strip().replace("-", "_").lower()


class ReportStore:
    """Finds and runs report functions over one connection."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self._sql = named_queries("finance_queries.sql")

    async def list_reports(self) -> list[Report]:
        """The report functions this role may run, by name."""
        with translate_errors():
            rows = await self._connection.fetch(self._sql["list_reports"])
        return [
            Report(name=row["name"], description=row["description"], columns=tuple(row["columns"]))
            for row in rows
        ]

    async def run(
        self, name: str, start: date, end: date, tenant: str | None = None
    ) -> ReportResult:
        """Run one report over [start, end); an empty period gives no rows."""
        wanted = normalize_name(name)
        known = {report.name for report in await self.list_reports()}
        if not _REPORT_NAME.match(wanted) or wanted not in known:
            listing = ", ".join(sorted(known)) or "none"
            raise UnknownReport(f"no report {name!r}; reports: {listing}")
        if tenant is not None:
            check_name("tenant", tenant)
        # The only text formatted into SQL: a name the catalog just listed.
        statement = self._sql["run_report"].format(report=f'"{wanted}"')
        with translate_errors():
            prepared = await self._connection.prepare(statement)
            records: Sequence[Row] = await prepared.fetch(start, end, tenant)
        columns = tuple(attribute.name for attribute in prepared.get_attributes())
        return ReportResult(
            name=wanted, columns=columns, rows=[tuple(record.values()) for record in records]
        )
