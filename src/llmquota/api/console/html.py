"""HTML of the console: the page around every view, tables, forms, escaping.

Plain strings, no template engine (none is a dependency). Every value that
reaches a page goes through `esc` (html.escape with quotes) exactly once, in
the helpers here: tenant names, labels and URLs are user input, and a name
like `<script>` must show as text. Helpers take text and return `Markup`, a
str subclass meaning "already HTML", so a view cannot pass raw text where
HTML belongs without escaping it.
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Sequence
from datetime import datetime
from decimal import Decimal
from urllib.parse import quote

from llmquota.domain.money import money_text


class Markup(str):
    """Text that is HTML already (escaped where it held values)."""

    __slots__ = ()

    def __add__(self, other: str) -> Markup:
        """Markup after markup; plain text added to markup is escaped first."""
        return Markup(str.__add__(self, esc(other)))


def esc(value: object) -> Markup:
    """A value as HTML text: markup passes as is, anything else is escaped."""
    if isinstance(value, Markup):
        return value
    return Markup(html.escape(_text(value), quote=True))


def _text(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, datetime):
        return value.strftime("%Y-%m-%d %H:%M:%S %Z").strip()
    if isinstance(value, Decimal):
        return money_text(value)  # as the API writes amounts: "12.5", "0.02"
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:,.2f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return str(value)


def join(parts: Iterable[Markup]) -> Markup:
    return Markup("".join(parts))


def path_part(name: str) -> str:
    """A name as one URL path segment (names are validated, but never trusted)."""
    return quote(name, safe="")


def link(href: str, text: object) -> Markup:
    return Markup(f'<a href="{esc(href)}">{esc(text)}</a>')


def table(
    headers: Sequence[str], rows: Iterable[Sequence[object]], *, test_id: str, empty: str = "none"
) -> Markup:
    """A table; each cell escaped (or Markup); `test_id` names it for the browser tests."""
    head = join(Markup(f"<th>{esc(h)}</th>") for h in headers)
    body = [
        Markup("<tr>") + join(Markup(f"<td>{esc(cell)}</td>") for cell in row) + Markup("</tr>")
        for row in rows
    ]
    if not body:
        body = [Markup(f'<tr><td colspan="{len(headers)}" class="empty">{esc(empty)}</td></tr>')]
    return Markup(
        f'<table data-testid="{esc(test_id)}"><thead><tr>{head}</tr></thead>'
        f"<tbody>{join(body)}</tbody></table>"
    )


def hidden_csrf(csrf_token: str) -> Markup:
    return Markup(f'<input type="hidden" name="csrf_token" value="{esc(csrf_token)}">')


def post_button(action: str, label: str, csrf_token: str, *, test_id: str) -> Markup:
    """A one-button form that POSTs to `action` with the session's CSRF token."""
    return Markup(
        f'<form method="post" action="{esc(action)}" class="inline">{hidden_csrf(csrf_token)}'
        f'<button type="submit" data-testid="{esc(test_id)}">{esc(label)}</button></form>'
    )


def section(title: str, body: Markup, *, test_id: str) -> Markup:
    return Markup(f'<section data-testid="{esc(test_id)}"><h2>{esc(title)}</h2>{body}</section>')


_STYLE = """
body{font-family:system-ui,sans-serif;margin:0;color:#1d2330;background:#f5f6f8}
header{background:#1d2330;color:#fff;padding:.6rem 1.2rem;display:flex;gap:1.2rem;
align-items:center}
header a{color:#cfe0ff;text-decoration:none} header form{margin-left:auto}
main{padding:1rem 1.2rem;max-width:72rem}
section{background:#fff;border:1px solid #dde1e8;border-radius:6px;padding:.6rem 1rem;
margin-bottom:1rem}
h1{font-size:1.3rem} h2{font-size:1.05rem;margin:.3rem 0 .6rem}
table{border-collapse:collapse;width:100%;font-size:.9rem}
th,td{text-align:left;padding:.25rem .5rem;border-bottom:1px solid #eceef2}
td.empty{color:#888} .inline{display:inline} .error{color:#b00020;font-weight:600}
.legend span{margin-right:1rem} .swatch{display:inline-block;width:.8rem;height:.8rem;
margin-right:.3rem;vertical-align:middle}
"""


def page(title: str, body: Markup, *, csrf_token: str | None = None) -> str:
    """A whole page; with a session (its CSRF token), the navigation and sign-out."""
    nav = Markup("")
    if csrf_token is not None:
        nav = Markup(
            '<a href="/console">Overview</a><a href="/console/alerts">Alerts</a>'
            '<a href="/docs">API (Swagger)</a>'
        ) + post_button("/console/logout", "Sign out", csrf_token, test_id="sign-out")
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{esc(title)} - llmquota</title><style>{_STYLE}</style></head>"
        f"<body><header><strong>llmquota</strong>{nav}</header>"
        f"<main><h1>{esc(title)}</h1>{body}</main></body></html>"
    )
