"""What a resource's `Allow` header says, and the answer to OPTIONS.

FastAPI registers one route per method, and Starlette's router answers a
method no route takes with the first route whose path matched: its 405
listed that one route's method (`Allow: PUT` on a resource that also takes
GET and DELETE), and OPTIONS got the same 405. Clients (and the schemathesis
checks in CI) read `Allow` to learn what a resource supports, so it lists
every method of every route on the path, with the HEAD Starlette adds to GET
and OPTIONS itself; OPTIONS is answered 204 with that header and no body.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match, Route

# In the order RFC 9110 lists them, so that the header reads the same every time.
_ORDER = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def allowed_methods(request: Request) -> list[str]:
    """Every method some route on the request's path takes, OPTIONS included; [] if none."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        if not isinstance(route, Route) or route.methods is None:
            continue
        match, _ = route.matches({**request.scope, "method": next(iter(route.methods))})
        if match is Match.FULL:
            methods |= route.methods
    if not methods:
        return []
    methods.add("OPTIONS")
    return sorted(methods, key=lambda method: _ORDER.index(method) if method in _ORDER else 99)


def options_answer(request: Request) -> Response | None:
    """204 with `Allow` for OPTIONS on a path some route serves; else None."""
    if request.method != "OPTIONS":
        return None
    methods = allowed_methods(request)
    if not methods:
        return None
    return Response(status_code=204, headers={"Allow": ", ".join(methods)})
