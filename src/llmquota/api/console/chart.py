"""The decisions-per-minute chart: inline SVG, drawn by the server.

One slot per minute of the window (the last hour), oldest on the left; in
each, a bar per outcome stacked bottom up (admitted, degraded, refused), its
height to scale with the busiest minute. A bar is drawn only for a count
above zero, and carries its minute, outcome and count as data attributes (and
a <title> a person sees on hover), so a test can count what a person sees.
No JavaScript.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta

from llmquota.api.console.html import Markup, esc, join
from llmquota.domain.decision_counts import MinuteCount

# The outcomes in stacking order, with their colours.
OUTCOME_COLOURS = (("admitted", "#2e7d32"), ("degraded", "#f9a825"), ("refused", "#c62828"))
WIDTH = 720
HEIGHT = 180
# Room for the axis labels left and below the plot.
LEFT = 40
BOTTOM = 20


def minute_totals(
    counts: Sequence[MinuteCount], start: datetime, minutes: int
) -> list[dict[str, int]]:
    """Per minute slot of the window, the decisions of each outcome (reasons summed)."""
    slots: list[dict[str, int]] = [{} for _ in range(minutes)]
    for count in counts:
        index = int((count.minute - start).total_seconds() // 60)
        if 0 <= index < minutes:
            slot = slots[index]
            slot[count.outcome] = slot.get(count.outcome, 0) + count.decisions
    return slots


def decisions_chart(counts: Sequence[MinuteCount], start: datetime, minutes: int) -> Markup:
    """The stacked bar chart of the window [start, start + minutes)."""
    slots = minute_totals(counts, start, minutes)
    peak = max((sum(slot.values()) for slot in slots), default=0) or 1
    plot_width = WIDTH - LEFT
    plot_height = HEIGHT - BOTTOM
    slot_width = plot_width / minutes
    bars: list[Markup] = []
    for index, slot in enumerate(slots):
        minute = start + timedelta(minutes=index)
        base = float(plot_height)
        for outcome, colour in OUTCOME_COLOURS:
            count = slot.get(outcome, 0)
            if count <= 0:
                continue
            height = count / peak * plot_height
            base -= height
            x = LEFT + index * slot_width + 1
            bars.append(
                Markup(
                    f'<rect class="bar" x="{x:.1f}" y="{base:.1f}" width="{slot_width - 2:.1f}" '
                    f'height="{height:.1f}" fill="{colour}" '
                    f'data-minute="{esc(minute.strftime("%H:%M"))}" data-outcome="{outcome}" '
                    f'data-count="{count}"><title>{esc(minute.strftime("%H:%M"))} '
                    f"{outcome}: {count}</title></rect>"
                )
            )
    axis = Markup(
        f'<line x1="{LEFT}" y1="{plot_height}" x2="{WIDTH}" y2="{plot_height}" stroke="#888"/>'
        f'<text x="{LEFT - 4}" y="12" text-anchor="end" font-size="11">{peak}</text>'
        f'<text x="{LEFT - 4}" y="{plot_height}" text-anchor="end" font-size="11">0</text>'
        f'<text x="{LEFT}" y="{HEIGHT - 4}" font-size="11">{esc(start.strftime("%H:%M"))}</text>'
        f'<text x="{WIDTH}" y="{HEIGHT - 4}" text-anchor="end" font-size="11">'
        f"{esc((start + timedelta(minutes=minutes - 1)).strftime('%H:%M'))} UTC</text>"
    )
    legend = join(
        Markup(f'<span><i class="swatch" style="background:{colour}"></i>{outcome}</span>')
        for outcome, colour in OUTCOME_COLOURS
    )
    return Markup(
        f'<svg data-testid="decisions-chart" xmlns="http://www.w3.org/2000/svg" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" role="img" '
        f'aria-label="decisions per minute by outcome">{axis}{join(bars)}</svg>'
        f'<div class="legend">{legend}</div>'
    )
