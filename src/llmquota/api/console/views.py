"""The console's pages as HTML, from domain records (no I/O here).

Figures are shown as the REST API answers them, so that a person comparing
the two sees the same numbers: balances floored to whole tokens (like
`remaining_tokens`), utilization as the ceilings' endpoint computes it.
Each table and figure has a `data-testid`, which the browser tests read.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import datetime

from llmquota.api.console.html import (
    Markup,
    esc,
    hidden_csrf,
    join,
    link,
    path_part,
    post_button,
    section,
    table,
)
from llmquota.domain.alerts import AlertEvent, Webhook
from llmquota.domain.decision_counts import MinuteCount, TenantDay
from llmquota.domain.keys import KeyRecord
from llmquota.domain.money import money_text
from llmquota.domain.plans import StoredCeiling
from llmquota.domain.quotas import CreditAccount, Quota
from llmquota.domain.records import LayerStatus
from llmquota.domain.response_cache import CachePolicy
from llmquota.domain.url_masking import mask_url


def whole(value: float | None) -> int | None:
    """A balance as the API shows it: floored to whole units."""
    return None if value is None else math.floor(value)


def percent(share: float | None) -> str | None:
    return None if share is None else f"{share * 100:.1f}%"


def sign_in_body(sign_in_token: str, error: str | None) -> Markup:
    """The sign-in form, after the refusal `error` when there was one.

    Every literal is Markup: plain text added to Markup is escaped, so a form
    written as a str after the error paragraph would show as text.
    """
    message = (
        Markup('<p class="error" data-testid="sign-in-error">') + esc(error) + Markup("</p>")
        if error
        else Markup("")
    )
    return (
        message
        + Markup('<form method="post" action="/console/login" data-testid="sign-in">')
        + hidden_csrf(sign_in_token)
        + Markup(
            '<label>Admin key <input type="password" name="key" autocomplete="off" '
            'data-testid="admin-key" size="48" autofocus></label> '
            '<button type="submit" data-testid="sign-in-button">Sign in</button></form>'
            "<p>Only an admin key opens the console; a tenant's key is refused.</p>"
        )
    )


def shedding_in_force(ceiling: StoredCeiling) -> str:
    """The ladder step that applies at the ceiling's utilization now, as a person reads it."""
    utilization = ceiling.utilization
    steps = [s for s in ceiling.ceiling.shed if utilization is not None and utilization > s.above]
    if not steps:
        return "none: every priority admitted"
    step = max(steps, key=lambda s: s.above)
    small = (
        f"; requests under {step.small_request_tokens} tokens too"
        if step.small_request_tokens
        else ""
    )
    return f"above {step.above:g}: only {', '.join(step.admit)}{small}"


def ceilings_table(ceilings: Sequence[StoredCeiling]) -> Markup:
    rows = [
        (
            c.name,
            ", ".join(c.ceiling.models),
            percent(c.utilization),
            whole(c.tokens),
            c.ceiling.effective_token_burst,
            c.in_flight,
            shedding_in_force(c),
        )
        for c in ceilings
    ]
    headers = (
        "ceiling",
        "models",
        "utilization",
        "tokens left",
        "capacity",
        "in flight",
        "shedding",
    )
    return table(headers, rows, test_id="ceilings", empty="no provider ceilings")


def cache_summary(cache: CachePolicy | None) -> str | None:
    """A layer's response cache as a person reads it: mode, lifetime, size, price."""
    if cache is None:
        return None
    how = (
        f"semantic >= {cache.similarity:g} ({cache.embedding_model})"
        if cache.mode == "semantic"
        else "exact"
    )
    parts = [how, f"{cache.ttl_seconds} s", f"{cache.max_entries} entries"]
    if cache.sampled:
        parts.append("sampled too")
    if not cache.serve_when_exhausted:
        parts.append("not when exhausted")
    if cache.hit_price_usd is not None:
        parts.append(f"{money_text(cache.hit_price_usd)} USD a hit")
    return ", ".join(parts)


def layers_table(layers: Sequence[LayerStatus], *, test_id: str) -> Markup:
    rows = [
        (
            layer.scope,
            layer.route,
            whole(layer.tokens),
            layer.policy.token_burst,
            layer.policy.tokens_per_minute,
            whole(layer.requests),
            layer.policy.request_burst,
            layer.in_flight,
            layer.policy.max_in_flight,
            cache_summary(layer.policy.cache),
        )
        for layer in layers
    ]
    headers = (
        "layer",
        "route",
        "tokens left",
        "token capacity",
        "tokens/min",
        "requests left",
        "request capacity",
        "in flight",
        "max in flight",
        "response cache",
    )
    return table(headers, rows, test_id=test_id, empty="no limits")


def decision_totals(counts: Sequence[MinuteCount]) -> Markup:
    totals: dict[tuple[str, str], int] = {}
    for count in counts:
        key = (count.outcome, count.reason)
        totals[key] = totals.get(key, 0) + count.decisions
    rows = [(outcome, reason, n) for (outcome, reason), n in sorted(totals.items())]
    return table(("outcome", "reason", "decisions"), rows, test_id="decision-totals")


def top_tenants_table(top: Sequence[TenantDay]) -> Markup:
    rows = [
        (
            link(f"/console/tenants/{path_part(t.tenant)}", t.tenant),
            t.requests,
            t.total_tokens,
            t.cost_usd,
            t.unpriced_tokens,
        )
        for t in top
    ]
    headers = ("tenant", "requests", "tokens", "cost (USD)", "unpriced tokens")
    return table(headers, rows, test_id="top-tenants", empty="no usage today")


def overview_body(
    ceilings: Sequence[StoredCeiling],
    global_layer: LayerStatus | None,
    chart: Markup,
    counts: Sequence[MinuteCount],
    top: Sequence[TenantDay],
) -> Markup:
    global_part = (
        layers_table([global_layer], test_id="global-layer")
        if global_layer
        else Markup("<p>No global policy: no limit shared by all tenants.</p>")
    )
    return join(
        (
            section("Provider ceilings", ceilings_table(ceilings), test_id="ceilings-section"),
            section("Global layer", global_part, test_id="global-section"),
            section(
                "Decisions per minute, last hour",
                chart + decision_totals(counts),
                test_id="decisions-section",
            ),
            section("Top tenants by tokens today (UTC)", top_tenants_table(top), test_id="top"),
            Markup(
                '<form method="get" action="/console/tenant">Tenant <input name="name" '
                'data-testid="tenant-search"> <button type="submit">Open</button></form>'
            ),
        )
    )


def quotas_table(quotas: Sequence[Quota]) -> Markup:
    rows = [
        (
            q.name,
            q.route,
            q.spec.period,
            q.spec.tokens,
            q.spec.cost,
            q.usage_tokens,
            q.usage_cost,
            q.window_start,
            q.window_end,
            q.spec.enforce,
        )
        for q in quotas
    ]
    headers = (
        "quota",
        "route",
        "period",
        "token limit",
        "cost limit",
        "tokens used",
        "cost used",
        "window start",
        "window end",
        "enforce",
    )
    return table(headers, rows, test_id="quotas", empty="no quotas")


def credits_part(account: CreditAccount) -> Markup:
    figures = table(
        ("balance", "reserved", "available"),
        [(account.balance, account.reserved, account.available)],
        test_id="credits",
    )
    ledger = table(
        ("entry", "amount", "reference", "recorded"),
        [(t.entry_id, t.amount, t.reference, t.recorded_at) for t in account.topups],
        test_id="credit-ledger",
        empty="no top-ups",
    )
    return figures + Markup("<h3>Last top-ups</h3>") + ledger


def keys_table(tenant: str, keys: Sequence[KeyRecord], csrf_token: str) -> Markup:
    rows: list[tuple[object, ...]] = []
    for k in keys:
        action: Markup | str = "revoked" if k.revoked_at else ""
        if k.revoked_at is None:
            action = post_button(
                f"/console/tenants/{path_part(tenant)}/keys/{k.key_id}/revoke",
                "Revoke",
                csrf_token,
                test_id=f"revoke-{k.key_id}",
            )
        listed = (k.key_id, k.prefix, k.label, " ".join(k.scopes), k.created_at, k.last_used_at)
        rows.append((*listed, k.expires_at, k.revoked_at, action))
    headers = ("id", "prefix", "label", "scopes", "created", "last used", "expires", "revoked", "")
    return table(headers, rows, test_id="keys", empty="no keys")


def refusals_table(refusals: Sequence[MinuteCount]) -> Markup:
    rows = [(r.minute, r.reason, r.decisions) for r in refusals]
    return table(
        ("minute", "reason", "refusals"), rows, test_id="refusals", empty="no refusals this hour"
    )


def alerts_table(alerts: Sequence[AlertEvent], *, with_tenant: bool) -> Markup:
    rows: list[tuple[object, ...]] = [
        (
            *(a.tenant, a.created_at, a.event_type, a.subject, a.threshold, a.usage, a.limit),
            *(a.deliveries, a.delivered, a.gave_up, a.deliveries - a.delivered - a.gave_up),
        )
        for a in alerts
    ]
    headers: tuple[str, ...] = ("tenant", "fired", "type", "subject", "threshold", "usage")
    headers += ("limit", "deliveries", "delivered", "gave up", "pending")
    if not with_tenant:
        rows = [row[1:] for row in rows]
        headers = headers[1:]
    return table(headers, rows, test_id="alerts", empty="no alerts")


def webhooks_table(webhooks: Sequence[Webhook]) -> Markup:
    rows = [(w.name, w.tenant or "every tenant", mask_url(w.url), w.updated_at) for w in webhooks]
    return table(("webhook", "tenant", "url", "updated"), rows, test_id="webhooks", empty="none")


def alerts_body(alerts: Sequence[AlertEvent], webhooks: Sequence[Webhook]) -> Markup:
    return section("Webhooks", webhooks_table(webhooks), test_id="webhooks-section") + section(
        "Recent alerts and their delivery", alerts_table(alerts, with_tenant=True), test_id="alerts"
    )


def stamp(now: datetime) -> Markup:
    return Markup(f'<p class="stamp">As of {esc(now)}.</p>')


def tenant_body(
    tenant: str,
    *,
    layers: Sequence[LayerStatus],
    quotas: Sequence[Quota],
    account: CreditAccount,
    keys: Sequence[KeyRecord],
    refusals: Sequence[MinuteCount],
    alerts: Sequence[AlertEvent],
    csrf_token: str,
) -> Markup:
    plan = next((layer.plan for layer in layers if layer.scope == "tenant"), None)
    return join(
        (
            Markup(f'<p>Plan: <span data-testid="plan">{esc(plan or "none")}</span></p>'),
            section("Layers", layers_table(layers, test_id="layers"), test_id="layers-section"),
            section("Quota windows", quotas_table(quotas), test_id="quotas-section"),
            section("Prepaid credits", credits_part(account), test_id="credits-section"),
            section("API keys", keys_table(tenant, keys, csrf_token), test_id="keys-section"),
            section("Recent refusals (last hour)", refusals_table(refusals), test_id="refusals"),
            section("Alerts", alerts_table(alerts, with_tenant=False), test_id="alerts-section"),
        )
    )
