"""CPU time a server spends: a process and every process it started.

The open loop's latency at a moderate rate is mostly what each request costs
the machine's two cores, and which process spends it (the HTTP server, or the
store behind it) says where a change would pay: BENCHMARKS.md, issue 25's
tenth part. A server's workers, and a PostgreSQL's backends and background
processes, are descendants of the process started, so one tree holds them
all; a child that exits during a run (a backend closed by the pool) is in
its parent's children's times once it is reaped, so the tree's total over a
run counts it too. The tree's background work (a sweeper, autovacuum) is in
the total: measure it idle where it matters (bench/open_loop_rates.py).
"""

from __future__ import annotations

import psutil


def tree_cpu_seconds(root: int) -> float:
    """User and kernel CPU of `root`, of its reaped children and of every live
    descendant, in seconds. A root that is gone raises psutil.NoSuchProcess:
    a server that died mid-run has no figure."""
    process = psutil.Process(root)
    tree = [process, *process.children(recursive=True)]
    total = 0.0
    for member in tree:
        try:
            times = member.cpu_times()
        except psutil.NoSuchProcess:  # exited since the tree was listed
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total
