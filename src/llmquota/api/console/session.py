"""Console sessions in the browser: cookies, forms and their CSRF tokens.

Signing in posts the admin key once; the server answers with a cookie
holding an opaque session token (never the key), HttpOnly (no script reads
it) and SameSite=Strict (no other site's page sends it), scoped to
/console. Every form carries the session's CSRF token and every POST checks
it (403 without it): SameSite is the first defence, the token the second.
The sign-in form has no session yet, so its token is a double-submit one: a
random value in a short-lived cookie of its own and in the form, which must
match.

Forms are parsed here (urlencoded, at most MAX_FORM_BYTES) rather than by
FastAPI's Form, which would need python-multipart for three small fields.
"""

from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass
from urllib.parse import parse_qs

from fastapi import Request, Response

from llmquota.admin.console import TOKEN_BYTES, ConsoleService

SESSION_COOKIE = "lq_console"
SIGN_IN_COOKIE = "lq_console_sign_in"
COOKIE_PATH = "/console"
# A sign-in form is good for this long (its double-submit cookie's age).
SIGN_IN_FORM_SECONDS = 3_600
# The console's forms hold a key and a token: a few hundred bytes.
MAX_FORM_BYTES = 8_192
MAX_FORM_FIELDS = 8


class SignInRequired(Exception):
    """No live session: the browser is sent to the sign-in page."""


class CsrfRefused(Exception):
    """A POST without its form's CSRF token (403); nothing was changed."""


class FormRefused(Exception):
    """A form that is not one (too large, not urlencoded): 400, nothing changed."""


@dataclass(frozen=True, slots=True)
class Session:
    """The signed-in browser's session: its token and its forms' CSRF token."""

    token: str
    csrf_token: str


def console_service(request: Request) -> ConsoleService:
    service: ConsoleService = request.app.state.console
    return service


async def current_session(request: Request) -> Session:
    """The request's live session, or SignInRequired."""
    token = request.cookies.get(SESSION_COOKIE)
    if not token or len(token) > 4 * TOKEN_BYTES:
        raise SignInRequired
    csrf_token = await console_service(request).session_csrf(token)
    if csrf_token is None:
        raise SignInRequired
    return Session(token, csrf_token)


async def read_form(request: Request) -> dict[str, str]:
    """The urlencoded form of a POST (the first value of each field)."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != "application/x-www-form-urlencoded":
        raise FormRefused("expected a form (application/x-www-form-urlencoded)")
    body = await request.body()
    if len(body) > MAX_FORM_BYTES:
        raise FormRefused(f"a console form is at most {MAX_FORM_BYTES} bytes")
    try:
        fields = parse_qs(
            body.decode("utf-8"), keep_blank_values=True, max_num_fields=MAX_FORM_FIELDS
        )
    except (UnicodeDecodeError, ValueError) as exc:
        raise FormRefused("the form could not be read") from exc
    return {name: values[0] for name, values in fields.items()}


def check_csrf(form: dict[str, str], expected: str | None) -> None:
    """CsrfRefused unless the form carries `expected` (compared in constant time)."""
    given = form.get("csrf_token", "")
    if not expected or not given or not hmac.compare_digest(given.encode(), expected.encode()):
        raise CsrfRefused


def new_sign_in_token() -> str:
    return secrets.token_urlsafe(TOKEN_BYTES)


def _secure(request: Request) -> bool:
    """Cookies are Secure when the console is reached over HTTPS."""
    return request.url.scheme == "https"


def set_cookie(
    response: Response, request: Request, name: str, value: str, max_age_seconds: int
) -> None:
    response.set_cookie(
        name,
        value,
        max_age=max_age_seconds,
        path=COOKIE_PATH,
        httponly=True,
        samesite="strict",
        secure=_secure(request),
    )


def clear_cookie(response: Response, request: Request, name: str) -> None:
    response.delete_cookie(
        name, path=COOKIE_PATH, httponly=True, samesite="strict", secure=_secure(request)
    )
