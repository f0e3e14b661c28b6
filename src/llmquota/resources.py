"""Where the package's data files are: SQL, migrations and tokenizer ranks.

A wheel carries `sql/` and `migrations/` inside the package (see pyproject's
force-include); an editable install reads them from the repository checkout.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_DIR = PACKAGE_DIR.parent.parent


def _first_existing(*candidates: Path) -> Path:
    for candidate in candidates:
        if candidate.exists():
            return candidate
    raise FileNotFoundError(f"none of these exist: {', '.join(map(str, candidates))}")


def sql_dir() -> Path:
    """The directory of hand-written SQL files."""
    return _first_existing(PACKAGE_DIR / "_sql", REPO_DIR / "sql")


def migrations_dir() -> Path:
    """The alembic script directory."""
    return _first_existing(PACKAGE_DIR / "_migrations", REPO_DIR / "migrations")


def encodings_dir() -> Path:
    """The tiktoken rank files shipped as package data."""
    return PACKAGE_DIR / "encodings"
