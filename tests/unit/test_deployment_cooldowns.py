"""The cooldown of a model's deployments (api/proxy/cooldown.py), as pure arithmetic:
which deployment is tried first, for how long a 429 or a run of failures sends
a deployment to the back, and what brings it forward again. `now` is passed in,
so every case is exact."""

from __future__ import annotations

import pytest

from llmquota.api.proxy.cooldown import DeploymentCooldowns, retry_after_seconds
from llmquota.config import MAX_DEPLOYMENT_COOLDOWN_SECONDS

RANKED = ["main", "azure", "backup"]
MODEL = "gpt-4o"


def cooldowns(seconds: float = 10.0, failures: int = 3, **options: int) -> DeploymentCooldowns:
    return DeploymentCooldowns(seconds=seconds, failures=failures, **options)


def test_a_429_sends_the_deployment_last_for_the_providers_retry_after() -> None:
    c = cooldowns()
    assert c.order(RANKED, MODEL, now=0.0) == RANKED
    assert c.refused("main", MODEL, now=100.0, retry_after=7.0) is True
    assert c.order(RANKED, MODEL, now=100.0) == ["azure", "backup", "main"]
    assert c.order(RANKED, MODEL, now=106.999) == ["azure", "backup", "main"]
    # Over: back in its rank, without anyone having to say so.
    assert c.order(RANKED, MODEL, now=107.0) == RANKED


def test_without_a_hint_the_setting_holds_and_a_hint_is_bounded() -> None:
    c = cooldowns(seconds=10.0)
    c.refused("main", MODEL, now=0.0)
    assert c.cooled("main", MODEL, now=9.99) and not c.cooled("main", MODEL, now=10.0)
    c.refused("azure", MODEL, now=0.0, retry_after=86_400.0)  # a provider naming a day
    assert c.cooled("azure", MODEL, now=MAX_DEPLOYMENT_COOLDOWN_SECONDS - 0.01)
    assert not c.cooled("azure", MODEL, now=MAX_DEPLOYMENT_COOLDOWN_SECONDS)


def test_failures_cool_at_the_threshold_in_a_row_and_a_good_answer_starts_again() -> None:
    c = cooldowns(failures=3)
    assert c.failed("main", MODEL, now=0.0) is False
    assert c.failed("main", MODEL, now=1.0) is False
    c.answered("main", MODEL, sent_at=1.5)  # not in a row any more
    assert c.failed("main", MODEL, now=2.0) is False
    assert c.failed("main", MODEL, now=3.0) is False
    assert not c.cooled("main", MODEL, now=3.0)
    assert c.failed("main", MODEL, now=4.0, retry_after=2.0) is True  # a 503's hint counts
    assert c.order(RANKED, MODEL, now=4.0) == ["azure", "backup", "main"]
    assert not c.cooled("main", MODEL, now=6.0)


def test_a_deployment_that_fails_again_after_its_cooldown_is_cooled_at_once() -> None:
    c = cooldowns(seconds=5.0, failures=3)
    for now in (0.0, 1.0, 2.0):
        c.failed("main", MODEL, now=now)
    assert c.cooled("main", MODEL, now=2.0)
    # Tried again once it is over: one failure is enough, no count of three anew.
    assert not c.cooled("main", MODEL, now=7.0)
    assert c.failed("main", MODEL, now=7.5) is True
    assert c.cooled("main", MODEL, now=12.4)
    # A good answer to an attempt sent after that: cooled no longer, the count reset.
    c.answered("main", MODEL, sent_at=8.0)
    assert c.order(RANKED, MODEL, now=8.0) == RANKED
    assert c.failed("main", MODEL, now=9.0) is False


def test_a_good_answer_ends_a_cooldown_only_if_it_was_sent_after_it_began() -> None:
    c = cooldowns()
    c.refused("main", MODEL, now=10.0, retry_after=30.0)
    c.answered("main", MODEL, sent_at=9.0)  # in flight before the 429: says nothing since
    assert c.cooled("main", MODEL, now=11.0)
    c.answered("main", MODEL, sent_at=12.0)  # tried while cooled, and it served
    assert not c.cooled("main", MODEL, now=12.5)


def test_concurrent_refusals_extend_one_cooldown_counted_once() -> None:
    c = cooldowns()
    assert c.refused("main", MODEL, now=0.0, retry_after=5.0) is True
    assert c.refused("main", MODEL, now=1.0, retry_after=2.0) is False  # ends no sooner
    assert c.refused("main", MODEL, now=2.0, retry_after=8.0) is False
    assert c.cooled("main", MODEL, now=9.9) and not c.cooled("main", MODEL, now=10.0)


def test_when_every_deployment_is_cooled_all_are_still_tried_the_soonest_back_first() -> None:
    c = cooldowns()
    c.refused("main", MODEL, now=0.0, retry_after=30.0)
    c.refused("azure", MODEL, now=1.0, retry_after=5.0)
    c.refused("backup", MODEL, now=2.0, retry_after=4.0)  # ends at 6, as azure does
    assert c.order(RANKED, MODEL, now=3.0) == ["azure", "backup", "main"]  # ties in rank
    assert c.order(["main", "azure"], MODEL, now=3.0) == ["azure", "main"]


def test_cooldowns_are_per_model() -> None:
    c = cooldowns()
    c.refused("main", "gpt-4o", now=0.0, retry_after=60.0)
    assert c.order(RANKED, "gpt-4o", now=1.0) == ["azure", "backup", "main"]
    assert c.order(RANKED, "gpt-4o-mini", now=1.0) == RANKED


def test_off_remembers_nothing() -> None:
    c = cooldowns(seconds=0.0)
    assert c.refused("main", MODEL, now=0.0, retry_after=7.0) is False
    for now in range(10):
        assert c.failed("main", MODEL, now=float(now)) is False
    assert c.order(RANKED, MODEL, now=1.0) == RANKED


def test_the_memory_is_bounded_the_oldest_forgotten_first() -> None:
    c = cooldowns(max_tracked=2)
    c.refused("main", "m1", now=0.0, retry_after=60.0)
    c.refused("main", "m2", now=0.0, retry_after=60.0)
    c.refused("main", "m3", now=0.0, retry_after=60.0)
    assert not c.cooled("main", "m1", now=1.0)  # forgotten: only tried in rank again
    assert c.cooled("main", "m2", now=1.0) and c.cooled("main", "m3", now=1.0)


@pytest.mark.parametrize(
    ("headers", "seconds"),
    [
        ({"retry-after-ms": "250", "retry-after": "7"}, 0.25),  # the finer one first
        ({"retry-after": "7"}, 7.0),
        ({"retry-after": "1.5"}, 1.5),
        ({"retry-after-ms": "soon", "retry-after": "2"}, 2.0),
        ({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}, None),
        ({"retry-after": "0"}, None),
        ({"retry-after": "-3"}, None),
        ({}, None),
    ],
)
def test_the_providers_hint_is_read_in_seconds(
    headers: dict[str, str], seconds: float | None
) -> None:
    assert retry_after_seconds(headers) == seconds


@pytest.mark.parametrize(
    ("seconds", "failures"),
    [(-1.0, 3), (MAX_DEPLOYMENT_COOLDOWN_SECONDS + 1, 3), (10.0, 0), (10.0, 101)],
)
def test_bounds_are_checked_where_it_is_built(seconds: float, failures: int) -> None:
    with pytest.raises(ValueError):
        DeploymentCooldowns(seconds=seconds, failures=failures)
