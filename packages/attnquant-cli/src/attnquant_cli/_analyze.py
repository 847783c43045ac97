"""``attnquant analyze``: error against compression over a G x r sweep, beside per-layer SVD.

With budgets, the auto form's frontier (each family's form and ranks chosen for the least
total error at each budget) is added beside per-layer SVD with globally allocated ranks.

With calibration statistics, every point also gets the relative output error of the same form
fit for the output error (whitened), predicted from the whitened spectra, and the frontier is
computed a second time fit and allocated for the output error (rows ``auto_output``).
Families without statistics for every layer have the weight error only (the JSON's
``calibration`` says which).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from attnquant_core import FrontierPoint, SweepResult
from attnquant_core.io import write_atomic

__all__ = [
    "CSV_FIELDS",
    "frontier_table",
    "sweep_table",
    "write_atomic",
    "write_csv",
    "write_json",
    "write_plot",
]


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
    "budget",  # frontier rows (family "auto" or "auto_output") only
    "forms",  # frontier rows: the form chosen per family
    "output_error",  # with --calibration: fit for the output error, its relative output error
    "svd_output_error",  # ... and the whitened per-layer SVD's at the same size
)


def _short(family: str) -> str:
    return family.split(".")[-1]


def forms_text(point: FrontierPoint) -> str:
    """``q_proj=lowrank;k_proj=shared_basis(in, G=3);...``: the form chosen per family."""
    return ";".join(f"{_short(n)}={label}" for n, label in point.forms.items())


def frontier_row(point: FrontierPoint) -> dict:
    """One CSV row: the auto form at a budget, per-layer SVD with global ranks in svd_*.

    A point fit for the output error (``objective == "output"``) is family ``auto_output``
    with its errors in ``output_error`` / ``svd_output_error``.
    """
    output = point.objective == "output"
    return {
        "family": "auto_output" if output else "auto",
        "blocks": "",
        "rank": "",
        "stored_parameters": point.stored,
        "dense_parameters": point.dense,
        "compression": point.compression,
        "error": "" if output else point.error,
        "svd_rank": "",
        "svd_stored_parameters": point.baseline_stored,
        "svd_error": "" if output else point.baseline_error,
        "budget": point.budget,
        "forms": forms_text(point),
        "output_error": point.error if output else "",
        "svd_output_error": point.baseline_error if output else "",
    }


def _difference(diff: float) -> str:
    """A signed error difference, green when below the baseline, red when above."""
    style = "green" if diff < 0 else "red" if diff > 0 else ""
    return f"[{style}]{diff:+.4f}[/{style}]" if style else f"{diff:+.4f}"


def frontier_table(points: Sequence[FrontierPoint], title: str) -> Table:
    """Per budget: the auto form's error, per-layer SVD with global ranks, and the forms."""
    table = Table(title=title)
    what = "output error" if points and points[0].objective == "output" else "error"
    for col in ("budget", "compression", f"auto {what}", f"per-layer SVD {what}", "auto - SVD"):
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
    """Totals per (G, r): theta error, per-layer SVD error at the same size, and which wins;
    with statistics the same for the output error of both fit for it."""
    table = Table(title=title)
    cols = ["G", "r", "compression", "theta error", "per-layer SVD error", "theta - SVD"]
    output = result.calibration is not None
    if output:
        cols += ["theta output error", "SVD output error", "theta - SVD (output)"]
    for col in cols:
        table.add_column(col, justify="right")
    for p in result.totals():
        row = [
            str(p.blocks),
            str(p.rank),
            f"{p.compression:.2f}x",
            f"{p.error:.4f}",
            f"{p.svd_error:.4f}",
            _difference(p.error - p.svd_error),
        ]
        if output and p.output_error is not None and p.svd_output_error is not None:
            row += [
                f"{p.output_error:.4f}",
                f"{p.svd_output_error:.4f}",
                _difference(p.output_error - p.svd_output_error),
            ]
        table.add_row(*row)
    return table


def write_csv(
    result: SweepResult,
    path: Path,
    *,
    frontier: Sequence[FrontierPoint] | None = None,
    output_frontier: Sequence[FrontierPoint] | None = None,
) -> None:
    """One row per (family or total, G, r), then one row per budget of each frontier."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, restval="")
        writer.writeheader()
        for p in result.points:
            row = p.to_json()
            writer.writerow({k: "" if v is None else v for k, v in row.items()})
        for point in [*(frontier or ()), *(output_frontier or ())]:
            writer.writerow(frontier_row(point))


def write_json(
    result: SweepResult,
    path: Path,
    *,
    checkpoint: str,
    frontier: Sequence[FrontierPoint] | None = None,
    output_frontier: Sequence[FrontierPoint] | None = None,
) -> None:
    """The points, the per-layer SVD curve and the budget frontier, with what was swept; with
    statistics, what they cover, the whitened SVD curve and the frontier fit for the output
    error."""
    payload = {
        "checkpoint": checkpoint,
        "blocks": sorted({p.blocks for p in result.points}),
        "ranks": sorted({p.rank for p in result.points}),
        "points": [p.to_json() for p in result.points],
        "svd_curve": result.svd_curve,
        "budget_frontier": [p.to_json() for p in frontier or ()],
        "calibration": result.calibration,
        "svd_output_curve": result.svd_output_curve,
        "budget_frontier_output": [p.to_json() for p in output_frontier or ()],
    }
    path.write_text(json.dumps(payload, indent=2) + "\n")


def write_plot(
    result: SweepResult,
    path: Path,
    *,
    title: str,
    frontier: Sequence[FrontierPoint] | None = None,
    output_frontier: Sequence[FrontierPoint] | None = None,
) -> None:
    """Total relative error against compression ratio: one theta curve per G, one SVD curve,
    and with budgets the auto form's frontier beside per-layer SVD with global ranks. With
    statistics, a second panel shows the same for the output error (forms fit for it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    output = result.calibration is not None
    fig, axes = plt.subplots(
        1, 2 if output else 1, figsize=(15 if output else 7.5, 5), dpi=120, squeeze=False
    )
    _panel(axes[0][0], result, "error", result.svd_curve, frontier)
    axes[0][0].set_ylabel("relative Frobenius error (all projections)")
    axes[0][0].set_title(title)
    if output:
        ax = axes[0][1]
        _panel(ax, result, "output_error", result.svd_output_curve, output_frontier)
        ax.set_ylabel("relative output error ||(W - W_hat) X|| / ||W X||")
        assert result.calibration is not None
        left_out = result.calibration["families_weight_error_only"]
        ax.set_title(
            "fit for the output error (calibration)"
            + (f"; without statistics: {len(left_out)} families" if left_out else "")
        )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _panel(
    ax,
    result: SweepResult,
    attr: str,
    svd_curve: Sequence[dict],
    frontier: Sequence[FrontierPoint] | None,
) -> None:
    """One error-against-compression panel (``attr``: ``error`` or ``output_error``)."""
    totals = [p for p in result.totals() if getattr(p, attr) is not None]
    for G in sorted({p.blocks for p in totals}):
        pts = sorted((p for p in totals if p.blocks == G), key=lambda p: p.compression)
        ax.plot(
            [p.compression for p in pts],
            [getattr(p, attr) for p in pts],
            marker="o",
            label=f"theta, G={G}",
        )
        _annotate(ax, pts, attr, lambda p: f"r={p.rank}", (3, 3))
    lo = min(p.compression for p in result.totals())
    curve = [c for c in svd_curve if c["stored_parameters"] > 0 and c["compression"] >= 0.5 * lo]
    ax.plot(
        [c["compression"] for c in curve],
        [c[attr] for c in curve],
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
        _annotate(ax, pts, "error", lambda p: f"b={p.budget:g}", (3, -9))
    ax.set_xscale("log")
    ax.set_xlabel("compression ratio (dense / stored parameters)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()


def _annotate(
    ax, points: Sequence, attr: str, text: Callable[[Any], str], offset: tuple[int, int]
) -> None:
    """Label each point of an error-against-compression curve, ``offset`` points off it."""
    for p in points:
        ax.annotate(
            text(p),
            (p.compression, getattr(p, attr)),
            fontsize=7,
            alpha=0.7,
            xytext=offset,
            textcoords="offset points",
        )
