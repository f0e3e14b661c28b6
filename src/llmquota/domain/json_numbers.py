"""Integers as JSON Schema reads them: a number without a fractional part.

Pure. The OpenAPI document declares counts, rates and seconds as
`"type": "integer"`, and JSON Schema (2020-12, which OpenAPI 3.1 uses)
says that 2.0 is an integer: the same number as 2, spelled differently,
and a generated client may well send it. So a `WholeNumber` field takes 2.0
as 2 and refuses what no schema calls an integer: 1.5, NaN, Infinity, 1e400
(Infinity once parsed), a string ("100") and a boolean (true, which a lax
int would take as 1).

Written as `Annotated[int, WholeNumber(ge=1, le=...)]`, with the bounds
inside: pydantic's own `Field(ge=...)` around a validator function shows in
the schema as `"ge"`, a keyword no JSON Schema tool knows, instead of
`"minimum"`, so the document would lose the bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pydantic import GetCoreSchemaHandler
from pydantic_core import core_schema


def _whole(value: object) -> object:
    """A finite float without a fractional part as its int; anything else as it came."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return value


@dataclass(frozen=True, slots=True)
class WholeNumber:
    """A strict integer in [ge, le] that also takes 2.0 (see the module docstring)."""

    ge: int | None = None
    le: int | None = None

    def __get_pydantic_core_schema__(
        self, _source: Any, _handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        return core_schema.no_info_before_validator_function(
            _whole, core_schema.int_schema(strict=True, ge=self.ge, le=self.le)
        )
