"""The price table shipped with llmquota (builtin_prices.csv beside this module).

`llmquota prices import --builtin` reads it here and writes it through
lq_import_builtin_prices (sql/ledger.sql), which decides, by the database
clock, what each row adds: nothing for a model an operator priced, nothing
when the version in force already has the row's prices, else a version set
by 'llmquota builtin'. Every row is checked as `prices set` checks its
flags before anything is written: a bad row stops the import whole.
"""

from __future__ import annotations

import csv
import io
from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from pathlib import Path

from llmquota.domain.errors import InvalidRequest
from llmquota.domain.validation import check_model
from llmquota.finance.ledger import LedgerStore, parse_effective_from, parse_price

BUILTIN_PRICES = Path(__file__).resolve().with_name("builtin_prices.csv")
COLUMNS = ["model", "effective_from", "input_usd_per_million", "output_usd_per_million"]
SOURCE_PREFIX = "# source:"
OUTCOMES = ("added", "unchanged", "operator", "superseded")


@dataclass(frozen=True, slots=True)
class BuiltinPrice:
    """One row of the shipped table, with the source its comment names."""

    model: str
    effective_from: datetime
    input_usd_per_million: Decimal
    output_usd_per_million: Decimal
    source: str


@dataclass(frozen=True, slots=True)
class ImportedPrice:
    """What an import did with one row."""

    model: str
    declared_from: datetime
    effective_from: datetime
    outcome: str


def load_builtin_prices(text: str | None = None) -> list[BuiltinPrice]:
    """Parse the table (the shipped file, or `text` in its format); refuse a
    row that is malformed, has no source, or repeats a (model, date)."""
    if text is None:
        text = BUILTIN_PRICES.read_text(encoding="utf-8")
    source = None
    data = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.startswith(SOURCE_PREFIX):
            source = line[len(SOURCE_PREFIX) :].strip()
        elif line.strip() and not line.startswith("#"):
            data.append((number, line, source))
    if not data or next(csv.reader([data[0][1]])) != COLUMNS:
        raise InvalidRequest(f"the price table must start with the header {','.join(COLUMNS)}")
    prices = [_row(number, line, source) for number, line, source in data[1:]]
    repeated = [
        key for key, n in Counter((p.model, p.effective_from) for p in prices).items() if n > 1
    ]
    if repeated:
        model, moment = repeated[0]
        raise InvalidRequest(f"the price table repeats {model} from {moment.date().isoformat()}")
    return prices


def _row(number: int, line: str, source: str | None) -> BuiltinPrice:
    fields = next(csv.reader(io.StringIO(line)))
    where = f"price table line {number}"
    if len(fields) != len(COLUMNS):
        raise InvalidRequest(f"{where}: {len(fields)} fields, not {len(COLUMNS)}")
    if not source or not source.startswith("https://"):
        raise InvalidRequest(f"{where}: no `# source: https://...` comment above it")
    model, effective_from, input_price, output_price = fields
    try:
        # A name as `prices set` takes it, but never a glob (check_model refuses `*`).
        check_model(model, "model")
        return BuiltinPrice(
            model=model,
            effective_from=parse_effective_from(effective_from),
            input_usd_per_million=parse_price("input", input_price),
            output_usd_per_million=parse_price("output", output_price),
            source=source,
        )
    except InvalidRequest as exc:
        raise InvalidRequest(f"{where}: {exc}") from None


async def import_builtin_prices(
    store: LedgerStore, prices: list[BuiltinPrice] | None = None
) -> list[ImportedPrice]:
    """Write the table (by default the shipped one) in one statement; what each row did."""
    rows = prices if prices is not None else load_builtin_prices()
    done = await store.import_builtin_prices(
        [
            (p.model, p.effective_from, p.input_usd_per_million, p.output_usd_per_million)
            for p in rows
        ]
    )
    return [ImportedPrice(*row) for row in done]
