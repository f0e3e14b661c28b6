"""The code stays in rooms a reader can hold: modules and functions are short.

One idea per module (at most MAX_MODULE_LINES lines) and one step per
function (at most MAX_FUNCTION_LINES lines, docstring included). SQL lives
in sql/ and is not counted here. import-linter (in CI) keeps the layers.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "llmquota"
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 60


def _modules() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def test_the_package_is_where_the_test_looks() -> None:
    assert (SRC / "admission" / "limiter.py").is_file()
    assert len(_modules()) > 40


def test_no_module_is_longer_than_the_limit() -> None:
    long = {
        str(path.relative_to(SRC)): lines
        for path in _modules()
        if (lines := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}


def test_no_function_is_longer_than_the_limit() -> None:
    long: dict[str, int] = {}
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(SRC)}:{node.lineno} {node.name}"] = lines
    assert long == {}
