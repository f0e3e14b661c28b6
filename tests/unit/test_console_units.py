"""The console's pure parts: the decision tally, the chart, escaping."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from llmquota.api.console.chart import decisions_chart, minute_totals
from llmquota.api.console.html import Markup, esc, table
from llmquota.api.console.views import cache_summary, sign_in_body
from llmquota.domain.decision_counts import OTHER_TENANTS, DecisionTally, MinuteCount, minute_of
from llmquota.domain.response_cache import CachePolicy

NOON = datetime(2026, 12, 2, 12, 0, tzinfo=UTC).timestamp()


def test_the_tally_counts_per_minute_and_drains_sorted_once() -> None:
    tally = DecisionTally()
    for offset in (0.0, 59.9, 60.0, 61.0):
        tally.add(NOON + offset, "zeta", "admitted", "none")
    tally.add(NOON + 5, "acme", "refused", "tenant_tokens")
    drained = tally.drain()
    assert drained == [
        ((minute_of(NOON), "acme", "refused", "tenant_tokens"), 1),
        ((minute_of(NOON), "zeta", "admitted", "none"), 2),
        ((minute_of(NOON) + 60, "zeta", "admitted", "none"), 2),
    ]
    assert tally.drain() == []


def test_counts_a_flush_could_not_write_are_added_back() -> None:
    tally = DecisionTally()
    tally.add(NOON, "acme", "admitted", "none")
    failed = tally.drain()
    tally.add(NOON + 1, "acme", "admitted", "none")
    tally.restore(failed)
    assert tally.drain() == [((minute_of(NOON), "acme", "admitted", "none"), 2)]


def test_past_its_bound_the_tally_folds_new_tenants_into_one_key() -> None:
    tally = DecisionTally(max_keys=3)
    for i in range(10):
        tally.add(NOON, f"tenant-{i}", "refused", "unknown_tenant")
    tally.add(NOON, "tenant-0", "refused", "unknown_tenant")  # known: still its own
    counts = dict(tally.drain())
    assert len(counts) == 4
    assert counts[(minute_of(NOON), "tenant-0", "refused", "unknown_tenant")] == 2
    assert counts[(minute_of(NOON), OTHER_TENANTS, "refused", "unknown_tenant")] == 7


def test_the_chart_draws_one_bar_per_minute_and_outcome_with_a_count() -> None:
    start = datetime(2026, 12, 2, 11, 0, tzinfo=UTC)
    counts = [
        MinuteCount(start, "admitted", "none", 4),
        MinuteCount(start, "refused", "tenant_tokens", 1),
        MinuteCount(start, "refused", "concurrency", 2),
        MinuteCount(start + timedelta(minutes=59), "degraded", "ceiling_shed", 5),
        MinuteCount(start + timedelta(minutes=60), "admitted", "none", 9),  # outside
    ]
    slots = minute_totals(counts, start, 60)
    assert slots[0] == {"admitted": 4, "refused": 3}
    assert slots[59] == {"degraded": 5}
    svg = decisions_chart(counts, start, 60)
    assert svg.count('class="bar"') == 3
    assert 'data-minute="11:00" data-outcome="refused" data-count="3"' in svg
    assert 'data-minute="11:59" data-outcome="degraded" data-count="5"' in svg


def test_every_value_is_escaped_once_and_markup_is_not() -> None:
    hostile = '<script>alert("x")</script>'
    assert esc(hostile) == "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;"
    assert esc(esc(hostile)) == esc(hostile)
    assert Markup("<b>") + hostile == "<b>&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;"
    html = table(("name",), [(hostile,)], test_id="t")
    assert "<script>" not in html
    assert esc(None) == "-"


def test_the_sign_in_form_is_html_after_a_refusal_and_the_refusal_is_text() -> None:
    """After a wrong key the page must still hold a working form (a str added to
    Markup is escaped, which once printed the form as text)."""
    for error in (None, "that key is not an admin key <b>"):
        body = sign_in_body("tok&en", error)
        assert body.count('<form method="post" action="/console/login"') == 1
        assert '<input type="password" name="key"' in body
        assert "&lt;form" not in body
        assert 'value="tok&amp;en"' in body
    assert "not an admin key &lt;b&gt;</p>" in sign_in_body("t", "that key is not an admin key <b>")
    assert "sign-in-error" not in sign_in_body("t", None)


def test_a_layers_response_cache_is_summed_up_in_one_cell() -> None:
    assert cache_summary(None) is None
    assert cache_summary(CachePolicy(mode="exact")) == "exact, 3600 s, 1000 entries"
    semantic = CachePolicy.model_validate(
        {
            "mode": "semantic",
            "embedding_model": "text-embedding-3-small",
            "similarity": 0.9,
            "ttl_seconds": 60,
            "max_entries": 5,
            "sampled": True,
            "serve_when_exhausted": False,
            "hit_price_usd": "0.00050",
        }
    )
    assert cache_summary(semantic) == (
        "semantic >= 0.9 (text-embedding-3-small), 60 s, 5 entries, sampled too, "
        "not when exhausted, 0.0005 USD a hit"
    )
