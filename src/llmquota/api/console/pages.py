"""The console's routes: sign-in, the overview, a tenant's page, alerts.

Every page but the sign-in needs a live session (else 303 to the sign-in
page); every POST checks its form's CSRF token (403). The figures come from
the same services the REST API reads (AdminService, AlertService) plus the
console's own (admin/console.py); nothing here touches the store.

Signing in checks the posted key exactly as the API's admin authentication
does (the Authenticator, with its failure budget per client address): a
wrong key and a tenant's key both get the sign-in page again with 401.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.responses import HTMLResponse, RedirectResponse

from llmquota.api.auth import AuthenticationFailed, Authenticator, TooManyFailedAuthentications
from llmquota.api.console import views
from llmquota.api.console.chart import decisions_chart
from llmquota.api.console.html import Markup, page, path_part
from llmquota.api.console.session import (
    SESSION_COOKIE,
    SIGN_IN_COOKIE,
    SIGN_IN_FORM_SECONDS,
    CsrfRefused,
    FormRefused,
    Session,
    SignInRequired,
    check_csrf,
    clear_cookie,
    console_service,
    current_session,
    new_sign_in_token,
    read_form,
    set_cookie,
)
from llmquota.api.dependencies import AdminDep, AlertServiceDep, TenantName
from llmquota.api.routes.keys import KeyId
from llmquota.domain.decision_counts import minute_datetime, minute_of
from llmquota.domain.errors import UnknownTenant

router = APIRouter(include_in_schema=False)
SessionDep = Annotated[Session, Depends(current_session)]

# The chart's window, the top tenants and the alerts a page shows.
CHART_MINUTES = 60
TOP_TENANTS = 10
RECENT_ALERTS = 100
TENANT_ALERTS = 20
# No page is cached, framed, or allowed a script or a form to another site.
_HEADERS = {
    "Cache-Control": "no-store",
    "X-Frame-Options": "DENY",
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
}


def _html(content: str, status_code: int = 200) -> HTMLResponse:
    return HTMLResponse(content, status_code=status_code, headers=_HEADERS)


def _see(location: str) -> RedirectResponse:
    return RedirectResponse(location, status_code=303, headers=_HEADERS)


def _sign_in_page(request: Request, error: str | None, status_code: int) -> HTMLResponse:
    token = new_sign_in_token()
    response = _html(page("Sign in", views.sign_in_body(token, error)), status_code)
    set_cookie(response, request, SIGN_IN_COOKIE, token, SIGN_IN_FORM_SECONDS)
    return response


@router.get("/console/login")
async def sign_in_form(request: Request) -> Response:
    return _sign_in_page(request, None, 200)


@router.post("/console/login")
async def sign_in(request: Request) -> Response:
    """Open a session for an admin key; anything else gets the form again (401)."""
    form = await read_form(request)
    check_csrf(form, request.cookies.get(SIGN_IN_COOKIE))
    authenticator: Authenticator = request.app.state.authenticator
    client = request.client.host if request.client else ""
    try:
        caller = await authenticator.caller(f"Bearer {form.get('key', '').strip()}", client)
    except AuthenticationFailed:
        return _sign_in_page(request, "That key is not valid.", 401)
    except TooManyFailedAuthentications as exc:
        return _sign_in_page(request, str(exc), 429)
    if not caller.is_admin:
        return _sign_in_page(
            request, "That is a tenant's key: only an admin key opens the console.", 401
        )
    session = await console_service(request).open_session(caller.key_id)
    response = _see("/console")
    seconds = request.app.state.settings.console_session_seconds
    set_cookie(response, request, SESSION_COOKIE, session.token, seconds)
    clear_cookie(response, request, SIGN_IN_COOKIE)
    return response


@router.post("/console/logout")
async def sign_out(request: Request, session: SessionDep) -> Response:
    check_csrf(await read_form(request), session.csrf_token)
    await console_service(request).close_session(session.token)
    response = _see("/console/login")
    clear_cookie(response, request, SESSION_COOKIE)
    return response


@router.get("/console")
async def overview(request: Request, session: SessionDep, admin: AdminDep) -> Response:
    """Ceilings and their shedding, the global layer, decisions per minute, top tenants."""
    console = console_service(request)
    now = datetime.now(UTC)
    start = minute_datetime(minute_of(now.timestamp())) - timedelta(minutes=CHART_MINUTES - 1)
    counts = await console.decisions_per_minute(start)
    body = views.overview_body(
        await admin.ceilings(),
        await console.global_layer(),
        decisions_chart(counts, start, CHART_MINUTES),
        counts,
        await console.top_tenants_today(TOP_TENANTS),
    )
    return _html(page("Overview", body + views.stamp(now), csrf_token=session.csrf_token))


@router.get("/console/tenant")
async def find_tenant(_: SessionDep, name: str = "") -> Response:
    """The overview's tenant box: to that tenant's page."""
    return _see(f"/console/tenants/{path_part(name.strip())}")


@router.get("/console/tenants/{tenant}")
async def tenant_page(
    request: Request,
    tenant: TenantName,
    session: SessionDep,
    admin: AdminDep,
    alerts: AlertServiceDep,
) -> Response:
    """Every layer, quota window, credit, key (with revoke), refusal and alert of a tenant."""
    now = datetime.now(UTC)
    try:
        layers = await admin.tenant_status(tenant)
    except UnknownTenant:
        missing = Markup("<p>No such tenant.</p>")
        return _html(page(f"Tenant {tenant}", missing, csrf_token=session.csrf_token), 404)
    body = views.tenant_body(
        tenant,
        layers=layers,
        quotas=await alerts.list_quotas(tenant),
        account=await alerts.credits(tenant),
        keys=await admin.keys.list(tenant),
        refusals=await console_service(request).tenant_refusals(tenant, CHART_MINUTES, now),
        alerts=await alerts.list_alerts(tenant, TENANT_ALERTS),
        csrf_token=session.csrf_token,
    )
    title = f"Tenant {tenant}"
    return _html(page(title, body + views.stamp(now), csrf_token=session.csrf_token))


@router.post("/console/tenants/{tenant}/keys/{key_id}/revoke")
async def revoke_key(
    request: Request, tenant: TenantName, key_id: KeyId, session: SessionDep, admin: AdminDep
) -> Response:
    """Revoke a key (as DELETE /v1/tenants/{t}/keys/{id}): refused at once on this worker."""
    check_csrf(await read_form(request), session.csrf_token)
    await admin.keys.revoke(tenant, key_id)
    authenticator: Authenticator = request.app.state.authenticator
    authenticator.key_id_changed(key_id)
    return _see(f"/console/tenants/{path_part(tenant)}")


@router.get("/console/alerts")
async def alerts_page(session: SessionDep, alerts: AlertServiceDep) -> Response:
    """Every tenant's recent alerts with their webhook delivery state, and the webhooks."""
    body = views.alerts_body(
        await alerts.recent_alerts(RECENT_ALERTS), await alerts.list_webhooks()
    )
    return _html(page("Alerts", body, csrf_token=session.csrf_token))


async def _to_sign_in(request: Request, exc: Exception) -> Response:
    return _see("/console/login")


async def _csrf_refused(request: Request, exc: Exception) -> Response:
    message = Markup(
        "<p>This form did not carry the console's token (or it expired): nothing was "
        'changed. <a href="/console">Back to the console</a>.</p>'
    )
    return _html(page("Refused", message), 403)


async def _form_refused(request: Request, exc: Exception) -> Response:
    return _html(page("Refused", Markup("<p>That was not a console form.</p>")), 400)


def install_console(app: FastAPI) -> None:
    """Serve /console on `app` (the lifespan puts its ConsoleService on app.state)."""
    app.include_router(router)
    app.add_exception_handler(SignInRequired, _to_sign_in)
    app.add_exception_handler(CsrfRefused, _csrf_refused)
    app.add_exception_handler(FormRefused, _form_refused)
