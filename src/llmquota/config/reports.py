"""The settings of the ledger export and the reports.

A part of `Settings` (settings.py), which inherits these fields and reads
them from LLMQUOTA_* variables like every other; kept apart only so that
each module stays one page of one topic. Never built on its own.
"""

from __future__ import annotations

from typing import Self

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings

from llmquota.config.renames import ENV_PREFIX
from llmquota.domain.oversubscription import (
    DEFAULT_CRITICAL_RATIO,
    DEFAULT_WARN_RATIO,
    MAX_RATIO,
    OversubscriptionRule,
)


class ReportSettings(BaseSettings):
    """Where and how long reports run, the oversubscription rule, the export's pages."""

    reporting_database_url: str | None = Field(
        default=None,
        description="DSN for `llmquota report` (e.g. as llmquota_reporting); unset: DATABASE_URL",
    )
    report_statement_timeout_ms: int = Field(
        default=120_000, ge=1_000, le=3_600_000, description="server-side cap on one report"
    )
    oversubscription_warn_ratio: float = Field(
        default=DEFAULT_WARN_RATIO,
        gt=0.0,
        le=MAX_RATIO,
        allow_inf_nan=False,
        description="the oversubscription report warns of a provider ceiling when the tenant "
        "limits that can reach it sum to more than this many times the ceiling",
    )
    oversubscription_critical_ratio: float = Field(
        default=DEFAULT_CRITICAL_RATIO,
        gt=0.0,
        le=MAX_RATIO,
        allow_inf_nan=False,
        description="the oversubscription report calls a provider ceiling critical when those "
        "limits sum to more than this many times it (at least the warn ratio)",
    )
    export_page_rows: int = Field(
        default=1_000, ge=1, le=10_000, description="ledger rows per export round trip"
    )
    export_number_limit: int = Field(
        default=10_000,
        ge=1,
        le=1_000_000,
        description="ledger rows the export numbers (gives export ids) per round trip",
    )

    @model_validator(mode="after")
    def _oversubscription_rule_is_ordered(self) -> Self:
        """A critical ratio below the warn ratio would make `warn` unreachable: refused."""
        if self.oversubscription_critical_ratio < self.oversubscription_warn_ratio:
            raise ValueError(
                f"{ENV_PREFIX}OVERSUBSCRIPTION_CRITICAL_RATIO "
                f"({self.oversubscription_critical_ratio}) is below "
                f"{ENV_PREFIX}OVERSUBSCRIPTION_WARN_RATIO ({self.oversubscription_warn_ratio})"
            )
        return self

    @property
    def oversubscription_rule(self) -> OversubscriptionRule:
        """The oversubscription report's verdict thresholds."""
        return OversubscriptionRule(
            warn_above=self.oversubscription_warn_ratio,
            critical_above=self.oversubscription_critical_ratio,
        )
