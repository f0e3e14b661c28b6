"""The schemathesis CLI, every check and every phase, against a real server: 0 failures.

`st run --checks all` over the examples, coverage, fuzzing and stateful
phases, 25 examples an operation, as the admin (who may reach every code
path), against `llmquota serve` in its own process on its own database. The
checks hold the server to its OpenAPI document both ways: no 500, every
status, content type, header and body as declared, every schema-valid
request accepted and every schema-violating one refused, `Allow` listing a
resource's methods, and the stateful phase following the document's links
(a tenant's policy, an admission, its settle, release and heartbeat).

The few refusals no schema can state (the clock, stored state, DNS) are
named, with why, in tests/faults/schemathesis/hooks.py; the run's report
counts what that hook dropped, and every other failure fails this test.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.acceptance.test_cli import _free_port, _wait_healthy
from tests.conftest import audit_findings

ADMIN_KEY = "lq_schemathesis_cli_admin_key_0123456789"
EXAMPLES_PER_OPERATION = 25
PHASES = "examples,coverage,fuzzing,stateful"
# Each phase's calls (54 operations; coverage alone makes over a thousand):
# a run that made fewer did not reach the API.
MIN_TEST_CASES = 2_000
REPOSITORY = Path(__file__).resolve().parents[2]
# CI replays one seed, so that a run fails for a change and not for a draw;
# LLMQUOTA_SCHEMATHESIS_SEED=random fuzzes afresh (how the findings behind
# the hook and the schema's patterns were made), any number replays that run.
SEED = os.environ.get("LLMQUOTA_SCHEMATHESIS_SEED", "190208568376412625438766470314508352934")
# Schemathesis's own list of the statuses that refuse a schema-violating
# request, and 413: a body past the server's size limit (fuzzing draws bodies
# of megabytes) is refused before it is parsed, which is a refusal too.
NEGATIVE_DATA_CONFIG = """
[checks.negative_data_rejection]
expected-statuses = ["400", "401", "403", "404", "405", "406", "409", "413", "415", "422",
                     "428", "429", "5xx"]
"""
ST = Path(sys.executable).with_name("st")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_schemathesis_cli_finds_no_failure(database_dsn: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMQUOTA_")}
    env.update(
        LLMQUOTA_DATABASE_URL=database_dsn,
        LLMQUOTA_ADMIN_KEY=ADMIN_KEY,
        # Not an outage test: a busy machine must not turn a slow answer into a 503.
        LLMQUOTA_DECISION_DEADLINE_MS="30000",
    )
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "llmquota.cli", "serve", "--port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _wait_healthy(base, server)
        report = _run_schemathesis(base, tmp_path)
    finally:
        server.send_signal(signal.SIGTERM)
        output = server.communicate(timeout=60)[0]
    assert server.returncode in (0, -signal.SIGTERM), output

    cases = report["test_cases"]["generated"]
    failures = {f["code"]: (f["count"], f["operations"]) for f in report["failures"]}
    print(
        f"FIGURE schemathesis CLI: {cases} test cases in {report['running_time']:.0f} s, "
        f"{len(failures)} kinds of failure, {report['filtered']} refusals no schema can state"
    )
    assert report["complete"] is True
    assert {name: phase["status"] for name, phase in report["phases"].items()} == {
        "examples": "skip",  # the document has no examples to replay
        "coverage": "success",
        "fuzzing": "success",
        "stateful": "success",
    }
    assert report["operations"]["tested"] == report["operations"]["total"]
    assert report["errors"] == []
    assert failures == {}
    assert report["exit_code"] == 0
    assert cases >= MIN_TEST_CASES
    assert asyncio.run(audit_findings(database_dsn)) == []


def _run_schemathesis(base: str, tmp_path: Path) -> dict[str, object]:
    """`st run` as a subprocess; its JSON report (the CLI's own summary, parsed)."""
    report_path = tmp_path / "schemathesis.json"
    config = tmp_path / "schemathesis.toml"
    config.write_text(NEGATIVE_DATA_CONFIG, encoding="utf-8")
    env = {
        **os.environ,
        "PYTHONPATH": str(REPOSITORY),
        "SCHEMATHESIS_HOOKS": "tests.faults.schemathesis.hooks",
    }
    completed = subprocess.run(
        [
            str(ST),
            "--config-file",
            str(config),
            "run",
            f"{base}/openapi.json",
            "--checks",
            "all",
            "--phases",
            PHASES,
            "--max-examples",
            str(EXAMPLES_PER_OPERATION),
            "--header",
            f"Authorization: Bearer {ADMIN_KEY}",
            "--request-timeout",
            "60",
            # One worker: hypothesis describes filter lambdas with ast.parse,
            # which CPython 3.11 can fail with "AST constructor recursion depth
            # mismatch" when two threads parse at once (a Runtime Error of the
            # coverage phase, not of the API).
            "--workers",
            "1",
            "--no-color",
            "--generation-database",
            "none",
            "--report",
            "json",
            "--report-json-path",
            str(report_path),
            *([] if SEED == "random" else ["--seed", SEED]),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )
    # Lines cut at 500 characters: a reproduction of a megabyte body would
    # otherwise push the failure's heading out of the captured tail.
    print("\n".join(line[:500] for line in completed.stdout.splitlines())[-20_000:])
    assert report_path.exists(), completed.stdout + completed.stderr
    report: dict[str, object] = json.loads(report_path.read_text())
    return report
