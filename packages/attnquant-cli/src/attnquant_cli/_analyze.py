"""``attnquant analyze``: error against compression over a G x r sweep, beside per-layer SVD.

With budgets, the auto form's frontier (each family's form and ranks chosen for the least
total error at each budget) is added beside per-layer SVD with globally allocated ranks.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from attnquant_core import FrontierPoint, SweepResult

__all__ = [
    "CSV_FIELDS",
    "frontier_table",
    "sweep_table",
    "write_atomic",
    "write_csv",
    "write_json",
    "write_plot",
]


def write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """Call ``write`` on a temporary sibling of ``path``, then rename it into place."""
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")  # keeps the suffix (format)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


CSV_FIELDS = (
    "family",
    "blocks",
    "rank",
    "stored_parameters",
    "dense_parameters",
    "compression",
    "error",
    "svd_rank",
    "svd_stored_parameters",
    "svd_error",
    "budget",  # frontier rows (family "auto") only
    "forms",  # frontier rows: the form chosen per family
)


def _short(family: str) -> str:
    return family.split(".")[-1]


def forms_text(point: FrontierPoint) -> str:
    """``q_proj=lowrank;k_proj=shared_basis(in, G=3);...``: the form chosen per family."""
    return ";".join(f"{_short(n)}={label}" for n, label in point.forms.items())


def frontier_row(point: FrontierPoint) -> dict:
    """One CSV row: the auto form at a budget, per-layer SVD with global ranks in svd_*."""
    return {
        "family": "auto",
        "blocks": "",
        "rank": "",
        "stored_parameters": point.stored,
        "dense_parameters": point.dense,
        "compression": point.compression,
        "error": point.error,
        "svd_rank": "",
        "svd_stored_parameters": point.baseline_stored,
        "svd_error": point.baseline_error,
        "budget": point.budget,
        "forms": forms_text(point),
    }


def _difference(diff: float) -> str:
    """A signed error difference, green when below the baseline, red when above."""
    style = "green" if diff < 0 else "red" if diff > 0 else ""
    return f"[{style}]{diff:+.4f}[/{style}]" if style else f"{diff:+.4f}"


def frontier_table(points: Sequence[FrontierPoint], title: str) -> Table:
    """Per budget: the auto form's error, per-layer SVD with global ranks, and the forms."""
    table = Table(title=title)
    for col in ("budget", "compression", "auto error", "per-layer SVD error", "auto - SVD"):
        table.add_column(col, justify="right")
    table.add_column("forms chosen", justify="left", overflow="fold")
    for p in points:
        counts: dict[str, int] = {}
        for label in p.forms.values():
            counts[label] = counts.get(label, 0) + 1
        table.add_row(
            f"{p.budget:g}",
            f"{p.compression:.2f}x",
            f"{p.error:.4f}",
            f"{p.baseline_error:.4f}",
            _difference(p.error - p.baseline_error),
            ", ".join(f"{n}x {label}" for label, n in counts.items()),
        )
    return table


def sweep_table(result: SweepResult, title: str) -> Table:
    """Totals per (G, r): theta error, per-layer SVD error at the same size, and which wins."""
    table = Table(title=title)
    for col in ("G", "r", "compression", "theta error", "per-layer SVD error", "theta - SVD"):
        table.add_column(col, justify="right")
    for p in result.totals():
        table.add_row(
            str(p.blocks),
            str(p.rank),
            f"{p.compression:.2f}x",
            f"{p.error:.4f}",
            f"{p.svd_error:.4f}",
            _difference(p.error - p.svd_error),
        )
    return table


def write_csv(
    result: SweepResult, path: Path, *, frontier: Sequence[FrontierPoint] | None = None
) -> None:
    """One row per (family or total, G, r), then one row per budget of the frontier."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, restval="")
        writer.writeheader()
        for p in result.points:
            writer.writerow(p.to_json())
        for point in frontier or ():
            writer.writerow(frontier_row(point))


def write_json(
    result: SweepResult,
    path: Path,
    *,
    checkpoint: str,
    frontier: Sequence[FrontierPoint] | None = None,
) -> None:
    """The points, the per-layer SVD curve and the budget frontier, with what was swept."""
    payload = {
        "checkpoint": checkpoint,
        "blocks": sorted({p.blocks for p in result.points}),
        "ranks": sorted({p.rank for p in result.points}),
        "points": [p.to_json() for p in result.points],
        "svd_curve": result.svd_curve,
        "budget_frontier": [p.to_json() for p in frontier or ()],
    }
    path.write_text(json.dumps(payload, indent=2) + "\n")


def write_plot(
    result: SweepResult,
    path: Path,
    *,
    title: str,
    frontier: Sequence[FrontierPoint] | None = None,
) -> None:
    """Total relative error against compression ratio: one theta curve per G, one SVD curve,
    and with budgets the auto form's frontier beside per-layer SVD with global ranks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5), dpi=120)
    totals = result.totals()
    for G in sorted({p.blocks for p in totals}):
        pts = sorted((p for p in totals if p.blocks == G), key=lambda p: p.compression)
        ax.plot(
            [p.compression for p in pts],
            [p.error for p in pts],
            marker="o",
            label=f"theta, G={G}",
        )
        _annotate(ax, pts, lambda p: f"r={p.rank}", (3, 3))
    lo = min(p.compression for p in totals)
    curve = [
        c for c in result.svd_curve if c["stored_parameters"] > 0 and c["compression"] >= 0.5 * lo
    ]
    ax.plot(
        [c["compression"] for c in curve],
        [c["error"] for c in curve],
        color="black",
        linestyle="--",
        label="per-layer truncated SVD",
    )
    if frontier:
        pts = sorted(frontier, key=lambda p: p.compression)
        ax.plot(
            [p.compression for p in pts],
            [p.error for p in pts],
            color="tab:red",
            marker="s",
            label="auto form at a budget",
        )
        ax.plot(
            [p.baseline_compression for p in pts],
            [p.baseline_error for p in pts],
            color="gray",
            marker="x",
            linestyle=":",
            label="per-layer SVD, globally allocated ranks",
        )
        _annotate(ax, pts, lambda p: f"b={p.budget:g}", (3, -9))
    ax.set_xscale("log")
    ax.set_xlabel("compression ratio (dense / stored parameters)")
    ax.set_ylabel("relative Frobenius error (all projections)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _annotate(ax, points: Sequence, text: Callable[[Any], str], offset: tuple[int, int]) -> None:
    """Label each point of an error-against-compression curve, ``offset`` points off it."""
    for p in points:
        ax.annotate(
            text(p),
            (p.compression, p.error),
            fontsize=7,
            alpha=0.7,
            xytext=offset,
            textcoords="offset points",
        )
