"""CPU time a server spends, read from /proc: a process and all it started.

The open loop's latency at a moderate rate is mostly what each request costs
the machine's two cores, and which process spends it (the HTTP server, or the
store behind it) says where a change would pay: BENCHMARKS.md, issue 25's
tenth part. A server's workers and a PostgreSQL's backends are children of
the process started, so one tree holds them all; a child that exits during a
run (a backend closed by the pool) is in its parent's `cutime`/`cstime` once
it is reaped, so the tree's total over a run counts it too.
"""

from __future__ import annotations

import os
from pathlib import Path

_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")
_PROC = Path("/proc")


def tree_cpu_seconds(root: int) -> float:
    """User and kernel CPU of `root`, of its reaped children and of every live
    descendant, in seconds; 0 for a process that is gone."""
    children: dict[int, list[int]] = {}
    spent: dict[int, float] = {}
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # The command name may hold spaces and parentheses: fields follow the last ")".
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited while we looked
            continue
        pid, parent = int(entry.name), int(fields[1])
        children.setdefault(parent, []).append(pid)
        # utime, stime, cutime, cstime: fields 14-17 of stat(5), 11-14 after the name.
        spent[pid] = sum(int(tick) for tick in fields[11:15]) / _TICKS_PER_SECOND
    total, stack = 0.0, [root]
    while stack:
        pid = stack.pop()
        total += spent.get(pid, 0.0)
        stack.extend(children.get(pid, ()))
    return total
