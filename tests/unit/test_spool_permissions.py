"""The outage spool is the owner's alone: directory 0700, files 0600, whatever the umask."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from llmquota.admission.outage import Spool


def test_spool_directory_and_files_are_owner_only_under_a_permissive_umask(
    tmp_path: Path,
) -> None:
    previous = os.umask(0o000)  # the widest umask: what the code itself asks for shows
    try:
        existing = tmp_path / "existing"
        existing.mkdir(mode=0o777)
        made = tmp_path / "made" / "spool"
        spools = [Spool(existing), Spool(made)]
    finally:
        os.umask(previous)
    try:
        for spool in spools:
            spool.append({"kind": "probe"})
            assert stat.S_IMODE(spool.directory.stat().st_mode) == 0o700
            assert stat.S_IMODE(spool.path.stat().st_mode) == 0o600
            assert spool.path.read_text().strip() == '{"kind":"probe"}'
    finally:
        for spool in spools:
            spool.close(remove=True)
