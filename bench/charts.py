"""PNG charts of a bench run (matplotlib, no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.colors import ListedColormap

from bench.burst import CAPACITY_TOKENS, TOKENS_PER_MINUTE, BurstResult
from bench.grid import KINDS, Cell
from bench.http_admission import HttpResult
from bench.library import Point

DPI = 110


def library_chart(points: Sequence[Point], path: Path) -> None:
    """Decisions/s and p99 against callers, one column per workload."""
    workloads = sorted({p.workload for p in points}, key=lambda w: w != "hot")
    fig, axes = plt.subplots(2, len(workloads), figsize=(6 * len(workloads), 7), squeeze=False)
    for column, workload in enumerate(workloads):
        systems = sorted({p.system for p in points if p.workload == workload})
        for system in systems:
            series = sorted(
                (p for p in points if p.workload == workload and p.system == system),
                key=lambda p: p.callers,
            )
            if len(series) < 2:
                continue  # single-point variants are in the table
            x = [p.callers for p in series]
            axes[0][column].plot(x, [p.result.per_second for p in series], "o-", label=system)
            axes[1][column].plot(x, [p.result.p99_ms for p in series], "o-", label=system)
        title = "one hot tenant" if workload == "hot" else "10,000 tenants"
        axes[0][column].set_title(f"{title}, global layer on")
        axes[0][column].set_ylabel("admissions / s")
        axes[1][column].set_ylabel("p99 latency (ms)")
        for row in (0, 1):
            axes[row][column].set_xscale("log", base=2)
            axes[row][column].set_xlabel("concurrent callers (one Python process)")
            axes[row][column].grid(alpha=0.3)
            axes[row][column].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def http_chart(results: Sequence[HttpResult], path: Path) -> None:
    labels = [f"{r.system}\n{r.workload}" for r in results]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    colors = ["tab:blue" if r.system.startswith("llmquota") else "tab:orange" for r in results]
    left.bar(labels, [r.per_second for r in results], color=colors)
    left.set_ylabel("admissions / s")
    right.bar(labels, [r.p99_ms for r in results], color=colors)
    right.set_ylabel("p99 latency (ms)")
    for ax in (left, right):
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"HTTP admission, 2 uvicorn workers, {results[0].connections} connections (wrk)")
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def burst_chart(results: Sequence[BurstResult], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for result in results:
        xs = [0.0] + [t for t, _ in result.timeline]
        ys = [0] + [tokens for _, tokens in result.timeline]
        ax.step(xs, ys, where="post", label=f"{result.strategy} ({result.overshoot:.2f}x)")
    window = results[0].window_s
    ax.plot(
        [0, window],
        [CAPACITY_TOKENS, CAPACITY_TOKENS + TOKENS_PER_MINUTE / 60 * window],
        "k--",
        label="budget: capacity + refill",
    )
    ax.set_xlabel("seconds since the burst began")
    ax.set_ylabel("tokens admitted (real usage of admitted requests)")
    ax.set_title(f"200 requests in 400 ms against a {CAPACITY_TOKENS:,}-token bucket")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def grid_chart(cells: Sequence[Cell], path: Path) -> None:
    rates = sorted({c.rate_per_s for c in cells})
    lengths = sorted({c.completion_tokens for c in cells})
    by_key = {(c.rate_per_s, c.completion_tokens): c for c in cells}
    matrix = [[KINDS.index(by_key[(r, n)].binding) for r in rates] for n in lengths]
    colors = ["#d9d9d9", "#e6550d", "#3182bd", "#31a354"]
    fig, ax = plt.subplots(figsize=(1.5 * len(rates) + 2.5, 1.0 * len(lengths) + 1.8))
    ax.imshow(matrix, cmap=ListedColormap(colors), vmin=0, vmax=len(KINDS) - 1, origin="lower")
    for y, n in enumerate(lengths):
        for x, r in enumerate(rates):
            cell = by_key[(r, n)]
            refused = sum(cell.refused.values())
            share = f"{100 * refused / cell.sent:.0f}% refused" if cell.sent else ""
            ax.text(x, y, f"{cell.binding}\n{share}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(rates)), [str(r) for r in rates])
    ax.set_yticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_xlabel("request rate (requests / s)")
    ax.set_ylabel("completion length (tokens)")
    ax.set_title("which limit binds (refuses the most requests)")
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
