"""README.md is a tested contract: every shell block runs, as written, against a live server.

The blocks (```sh, ```bash, ```shell, indented ones inside a list too) run in
README order in one bash session under `set -euo pipefail`, so that a
variable a block sets (ADMIN, H, J, KEY...) is there for the blocks after
it, as a reader's terminal would have it. The server is the real `llmquota
serve` on a fresh database of the test server, started as the README's first
line starts it (no admin key configured: it generates one and prints it),
with `--access-log` so that the test sees the status of every request.

Two things stand between the text and the run, both honest:

- `curl` reaches `localhost:8080` through a `.curlrc` (`connect-to`) that
  sends it to the test server's port: the commands are untouched.
- `ADMIN=lq_...` (the walk-through's "the key `serve` printed") becomes the
  key this `serve` printed: the one placeholder a reader fills in by hand.

A block that cannot run here says so right above it, where a reader sees
it too: `<!-- not run: REASON -->` (the set-up commands themselves, a
`serve` with real provider keys). The test asserts how many blocks ran and
were skipped, that each ran to its end, that the server answered every
request (one per `curl` in the blocks) with a 2xx, and that the settle of the
walk-through's reservation was recorded in the ledger, and that the
audit finds no drift afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import httpx
import pytest

from tests.conftest import audit_findings

README = Path(__file__).resolve().parents[2] / "README.md"
LLMQUOTA = [sys.executable, "-m", "llmquota.cli"]
_FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w-]*)\s*$")
_SHELLS = frozenset({"sh", "bash", "shell"})
_NOT_RUN = re.compile(r"^\s*<!-- not run: (?P<reason>.+?) -->\s*$")
_PLACEHOLDER = re.compile(r"^(?P<name>[A-Z_]+)=lq_\.\.\.(?=\s|$)", re.MULTILINE)
_CURL = re.compile(r"(?<![\w-])curl\s")
_ACCESS = re.compile(r'"(?P<method>[A-Z]+) (?P<path>\S+) HTTP/[\d.]+" (?P<status>\d{3})')
# The README as it stands: shell blocks run, and the ones marked not run.
BLOCKS_RUN = 15
BLOCKS_NOT_RUN = 2
# The curl commands in the blocks run: each one request, each answered 2xx.
CURLS = 48


@dataclass(frozen=True, slots=True)
class Block:
    """A shell block of the README: where it starts, its text, why it is not run."""

    line: int
    text: str
    not_run: str | None


def shell_blocks(markdown: str) -> list[Block]:
    """Every fenced shell block, dedented by its fence's indentation, in order."""
    blocks: list[Block] = []
    lines = markdown.splitlines()
    index = 0
    while index < len(lines):
        fence = _FENCE.match(lines[index])
        if fence is None or not fence["lang"]:
            index += 1
            continue
        end = index + 1
        while _FENCE.match(lines[end]) is None:
            end += 1
        if fence["lang"] in _SHELLS:
            indent = len(fence["indent"])
            body = "\n".join(line[indent:] for line in lines[index + 1 : end])
            before = next((line for line in reversed(lines[:index]) if line.strip()), "")
            marker = _NOT_RUN.match(before)
            blocks.append(Block(index + 1, body + "\n", marker["reason"] if marker else None))
        index = end + 1
    return blocks


def _without_comments(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))


def script(blocks: list[Block], admin_key: str) -> str:
    """One bash script of the blocks to run, each followed by a line saying it ended."""
    parts = ["set -euo pipefail"]
    for number, block in enumerate(blocks, 1):
        text = _PLACEHOLDER.sub(lambda m: f"{m['name']}={admin_key}", block.text)
        parts.append(f"echo '>>> README block {number} (line {block.line})' >&2")
        parts.append(text)
        parts.append(f"echo '<<< README block {number} ran' >&2")
    return "\n".join(parts) + "\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _environment(**variables: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMQUOTA_")}
    # `llmquota` and `python3` as the README types them: this interpreter's.
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.update(variables)
    return env


class Serve:
    """`llmquota serve --access-log` as a subprocess; every line it printed."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.lines: list[str] = []
        self._reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        assert self.process.stdout is not None
        async for raw in self.process.stdout:
            self.lines.append(raw.decode(errors="replace").rstrip("\n"))

    async def finished(self) -> None:
        """Every line the process printed has been read."""
        await self._reader

    def admin_key(self) -> str | None:
        """The key serve generated and printed ("store it now:" then the key)."""
        for before, line in zip(self.lines, self.lines[1:], strict=False):
            if before.endswith("store it now:"):
                return line.strip()
        return None

    def requests(self) -> list[tuple[str, str, int]]:
        """(method, path, status) of every request the access log shows but health probes."""
        found = [m for line in self.lines if (m := _ACCESS.search(line))]
        return [
            (m["method"], m["path"], int(m["status"])) for m in found if m["path"] != "/healthz"
        ]


@contextlib.asynccontextmanager
async def serving(dsn: str, port: int) -> AsyncIterator[Serve]:
    """The README's `llmquota serve` on `dsn`, healthy and with its admin key printed."""
    process = await asyncio.create_subprocess_exec(
        *LLMQUOTA,
        *("serve", "--port", str(port), "--access-log"),
        env=_environment(LLMQUOTA_DATABASE_URL=dsn),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    serve = Serve(process)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as probe:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 90
            while True:
                assert process.returncode is None, "\n".join(serve.lines)
                assert loop.time() < deadline, "serve did not start:\n" + "\n".join(serve.lines)
                with contextlib.suppress(httpx.TransportError):
                    # The key is printed before the server starts; its line may
                    # still be in the pipe when the first probe is answered.
                    healthy = (await probe.get("/healthz")).status_code == 200
                    if healthy and serve.admin_key() is not None:
                        break
                await asyncio.sleep(0.2)
        yield serve
    finally:
        with contextlib.suppress(ProcessLookupError):
            process.terminate()
        await process.wait()
        await serve.finished()


async def _wait_for_requests(serve: Serve, count: int) -> None:
    """The access log is written as each answer goes: wait until it shows `count`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while loop.time() < deadline:
        if len(serve.requests()) >= count:
            return
        await asyncio.sleep(0.1)


def test_the_readme_marks_exactly_the_blocks_it_cannot_run() -> None:
    blocks = shell_blocks(README.read_text(encoding="utf-8"))
    skipped = [b for b in blocks if b.not_run]
    assert len(blocks) - len(skipped) == BLOCKS_RUN
    assert len(skipped) == BLOCKS_NOT_RUN
    # The first block is the two set-up commands, as they were: serve, then the tests.
    first = blocks[0].text.splitlines()
    assert first[0].startswith("pip install -e . && llmquota serve ")
    assert first[1].startswith("pip install -e '.[dev]' && pytest ")
    assert blocks[0].not_run is not None


@pytest.mark.timeout(600)
async def test_every_readme_shell_block_runs_as_written(database_dsn: str, tmp_path: Path) -> None:
    blocks = [b for b in shell_blocks(README.read_text(encoding="utf-8")) if b.not_run is None]
    assert len(blocks) == BLOCKS_RUN
    curls = sum(len(_CURL.findall(_without_comments(b.text))) for b in blocks)
    port = _free_port()
    home = tmp_path / "home"
    home.mkdir()
    (home / ".curlrc").write_text(f"connect-to = localhost:8080:127.0.0.1:{port}\n")
    async with serving(database_dsn, port) as serve:
        admin_key = serve.admin_key()
        assert admin_key is not None and admin_key.startswith("lq_"), serve.lines
        bash = await asyncio.create_subprocess_exec(
            "bash",
            "-c",
            script(blocks, admin_key),
            cwd=tmp_path,
            env=_environment(
                HOME=str(home), CURL_HOME=str(home), LLMQUOTA_DATABASE_URL=database_dsn
            ),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        raw, _ = await asyncio.wait_for(bash.communicate(), 480)
        output = raw.decode(errors="replace")
        await _wait_for_requests(serve, curls)
        requests = serve.requests()
    assert bash.returncode == 0, output
    for number in range(1, BLOCKS_RUN + 1):
        assert f"<<< README block {number} ran" in output, output
    failed = [r for r in requests if not 200 <= r[2] < 300]
    assert failed == [], output
    assert curls == CURLS
    assert len(requests) == CURLS, requests
    connection = await asyncpg.connect(database_dsn)
    try:
        settled = await connection.fetchval(
            "SELECT count(*) FROM usage_ledger WHERE tenant = 'acme' AND output_tokens = 350"
        )
    finally:
        await connection.close()
    assert settled == 1
    # Whatever the README did, the books agree with themselves.
    assert await audit_findings(database_dsn) == []
