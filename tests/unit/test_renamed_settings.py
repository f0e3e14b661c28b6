"""Settings renamed so one word means one thing: the old variable still works for a release.

`waiting` is for room (max_wait_ms), `queued` for a connection (the fair
share), `in_flight` for held permits; the three variables that used those
words otherwise were renamed. A deployment that still sets the old name
gets its value and a warning naming the new one; the new name wins when
both are set.
"""

from __future__ import annotations

import logging

import pytest

from llmquota.config.renames import RENAMED_VARIABLES
from llmquota.config.settings import Settings

# new field -> (old variable, a value unlike the default)
CASES = {
    "tenant_max_queued": ("LLMQUOTA_TENANT_MAX_WAITING", 17),
    "tenant_max_waiting_for_room": ("LLMQUOTA_WAIT_QUEUE_PER_TENANT", 9),
    "batch_max_running": ("LLMQUOTA_BATCH_MAX_IN_FLIGHT", 3),
}


def test_the_renamed_fields_are_the_ones_listed() -> None:
    assert {field: old for field, (old, _) in CASES.items()} == RENAMED_VARIABLES


@pytest.mark.parametrize("field", sorted(CASES))
def test_the_old_variable_is_read_with_a_warning(
    field: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    old, value = CASES[field]
    monkeypatch.setenv(old, str(value))
    with caplog.at_level(logging.WARNING, logger="llmquota.config"):
        settings = Settings()
    assert getattr(settings, field) == value
    assert [r.getMessage() for r in caplog.records] == [
        f"{old} is deprecated: set LLMQUOTA_{field.upper()} (read for one more release)"
    ]


@pytest.mark.parametrize("field", sorted(CASES))
def test_the_new_variable_wins_and_the_field_is_set_by_name(
    field: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    old, value = CASES[field]
    monkeypatch.setenv(old, str(value))
    monkeypatch.setenv(f"LLMQUOTA_{field.upper()}", str(value + 1))
    assert getattr(Settings(), field) == value + 1
    monkeypatch.delenv(old)
    assert getattr(Settings(**{field: value + 2}), field) == value + 2


def test_without_the_old_names_nothing_is_said(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for old, _ in CASES.values():
        monkeypatch.delenv(old, raising=False)
    with caplog.at_level(logging.WARNING, logger="llmquota.config"):
        Settings()
    assert caplog.records == []
