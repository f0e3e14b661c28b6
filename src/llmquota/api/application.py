"""The FastAPI application class, without the outer layers this service leaves idle.

FastAPI runs every HTTP request through three layers before the app's own
middlewares: Starlette's ServerErrorMiddleware (a plain-text 500 for an
exception nobody handled), its own ExceptionTelemetryMiddleware (that
exception on an OpenTelemetry span) and AppBodyLimitMiddleware (its
`max_body_size`), after asking whether OpenTelemetry is configured (three
provider lookups, each reading the environment). None of them has work here:
the outermost middleware of the app (llmquota.api.requestids) answers every
unhandled exception in the one error shape, llmquota.api.bodylimit bounds
bodies, and without OpenTelemetry providers there are no spans. Every admit
and settle paid for them all the same, a few microseconds of a budget of a
few hundred (BENCHMARKS.md).

`Application` enters its stack at its outermost own middleware instead,
unless OpenTelemetry is configured when the first request arrives (as
`opentelemetry-instrument` does before the app starts): then every request
takes FastAPI's whole path, spans included. Lifespan events always do.
"""

from __future__ import annotations

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send


class Application(FastAPI):
    """FastAPI, entered at the app's own outermost middleware when nothing outside has work."""

    _own_stack: ASGIApp | None = None
    _whole_path = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._whole_path:
            await super().__call__(scope, receive, send)
            return
        stack = self._own_stack
        if stack is None:
            stack = self._enter_own_stack()
            if stack is None:
                await super().__call__(scope, receive, send)
                return
        if self.root_path:
            scope["root_path"] = self.root_path
        scope["app"] = self
        await stack(scope, receive, send)

    def _enter_own_stack(self) -> ASGIApp | None:
        """The app's outermost own middleware; None (and FastAPI's path from now on)
        when OpenTelemetry is configured or the app has no middleware of its own."""
        if self._native_telemetry.enabled() or not self.user_middleware:
            self._whole_path = True
            return None
        outermost = self.user_middleware[0].cls
        if not isinstance(outermost, type):  # a factory: nothing to recognise it by
            self._whole_path = True
            return None
        if self.middleware_stack is None:
            self.middleware_stack = self.build_middleware_stack()
        layer: ASGIApp = self.middleware_stack
        while not isinstance(layer, outermost):
            inner = getattr(layer, "app", None)
            if inner is None:
                self._whole_path = True
                return None
            layer = inner
        self._own_stack = layer
        return layer
