"""schemathesis against the app's own OpenAPI schema, over real HTTP.

Every operation is called with generated data (valid and invalid) as the
admin, who may reach every code path. No response may be a 500, and every
response must match what the schema declares: its status, content type and
body (errors included: they are declared in the one error shape).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
import uvicorn
from hypothesis import HealthCheck, assume, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode, checks

from llmquota.api.app import create_app
from tests.conftest import _admin, audit_findings, dsn_with_database
from tests.faults.conftest import fault_settings

ADMIN_KEY = "lq_schemathesis_admin_key_0123456789"
EXAMPLES_PER_OPERATION = 25
CHECKS = [
    checks.not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_schema_conformance,
    checks.negative_data_rejection,
]


@pytest.fixture(scope="module")
def live_api(server_dsn: str, template_database: str) -> Iterator[dict[str, Any]]:
    """A real uvicorn server on its own database, in a thread; its schema and URL."""
    name = f"llmquota_schemathesis_{time.time_ns()}"
    asyncio.run(_admin(server_dsn, f'CREATE DATABASE "{name}" TEMPLATE "{template_database}"'))
    dsn = dsn_with_database(server_dsn, name)
    # Not an outage test: a busy machine must not turn a slow answer into a 503.
    app = create_app(fault_settings(admin_key=ADMIN_KEY, decision_deadline_ms=30_000), dsn=dsn)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield {
        "schema": schemathesis.openapi.from_dict(app.openapi()),
        "url": f"http://127.0.0.1:{port}",
    }
    server.should_exit = True
    thread.join(timeout=30)
    assert asyncio.run(audit_findings(dsn)) == []
    asyncio.run(_admin(server_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.mark.slow
def test_api_never_500s_and_matches_its_schema(live_api: dict[str, Any]) -> None:
    schema = live_api["schema"]
    failures: dict[str, str] = {}
    calls = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(
                max_examples=EXAMPLES_PER_OPERATION,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            def call(case: Any) -> None:
                nonlocal calls
                # A path segment "." or ".." is removed by the client before it
                # is sent (RFC 3986, 5.2.4): the server never sees it as a name
                # (a negative case for names, which may not start with "."), and
                # the request goes to another path, proving nothing either way.
                values = (case.path_parameters or {}).values()
                assume(not any(value in (".", "..") for value in values))
                calls += 1
                case.call_and_validate(
                    base_url=live_api["url"],
                    headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                    checks=CHECKS,
                )

            try:
                call()
            except Unsatisfiable:
                continue  # an operation without inputs has no invalid ones
            except (Exception, BaseExceptionGroup) as exc:  # every operation, not the first
                failures[f"{operation.label} ({mode.value})"] = str(exc)[:2_000]
    print(f"FIGURE schemathesis: {calls} generated calls, {len(failures)} failing operations")
    for label, failure in failures.items():
        print(f"FAILURE {label}: {failure}")
    assert failures == {}
