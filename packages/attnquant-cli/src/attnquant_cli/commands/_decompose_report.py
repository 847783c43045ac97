"""What ``attnquant decompose`` prints: its tables, its calibration line and ``--json``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rich.table import Table

from ._shared import console, print_json

if TYPE_CHECKING:
    from attnquant_core import BudgetReport

__all__ = [
    "SUMMARY_KEYS",
    "budget_table",
    "family_bytes",
    "fixed_table",
    "print_json_summary",
    "say_calibrated",
]

# What ``decompose --json`` reports of each family (the manifest's per-family figures).
SUMMARY_KEYS = (
    "form",
    "side",
    "shape",
    "blocks",
    "rank",
    "ranks",
    "error",
    "stored_parameters",
    "dense_parameters",
    "quant",
    "stored_bytes",
)


def print_json_summary(output: Path, wanted: bool) -> None:
    """``--json``: the written checkpoint's figures as one JSON object on stdout."""
    if not wanted:
        return
    import json

    from attnquant_core import MANIFEST_FILE

    manifest = json.loads((output / MANIFEST_FILE).read_text())
    families = {
        name: {key: fam[key] for key in SUMMARY_KEYS if key in fam}
        for name, fam in manifest["families"].items()
    }
    stored = sum(f["stored_parameters"] for f in families.values())
    dense = sum(f["dense_parameters"] for f in families.values())
    summary = {
        "output": str(output),
        "blocks": manifest.get("blocks"),
        "rank": manifest.get("rank"),
        "stored_parameters": stored,
        "dense_parameters": dense,
        "families": families,
    }
    if any("stored_bytes" in f for f in families.values()):
        summary["stored_bytes"] = sum(family_bytes(f)[0] for f in manifest["families"].values())
        summary["dense_bytes"] = sum(family_bytes(f)[1] for f in manifest["families"].values())
    if "budget" in manifest:
        summary["budget"] = manifest["budget"]
    if "calibration" in manifest:
        summary["calibration"] = manifest["calibration"]
    print_json(summary)


def fixed_table(manifest: dict, output: Path, quant: str | None) -> Table:
    """Per family at fixed bands and rank: shape, bands, rank, error, size; then the totals."""
    what = f"G={manifest['blocks']}, r={manifest['rank']}" + (f", W0 {quant}" if quant else "")
    table = Table(title=f"{output}  ({what})")
    columns = ["family", "shape", "bands", "rank", "rel. error", "stored / dense"]
    if quant:  # parameters say little of a 4-bit W0: its bytes (4.5 bits a weight) say more
        columns += ["stored bytes", "bytes / dense"]
    for col in columns:
        table.add_column(col, justify="left" if col == "family" else "right")
    total_stored = total_dense = total_bytes = total_dense_bytes = 0
    for name, fam in manifest["families"].items():
        out_dim, in_dim = fam["shape"]
        stored, dense = fam["stored_parameters"], fam["dense_parameters"]
        nbytes, dense_bytes = family_bytes(fam)
        total_stored += stored
        total_dense += dense
        total_bytes += nbytes
        total_dense_bytes += dense_bytes
        row = [
            name,
            f"{out_dim}x{in_dim}",
            str(fam["blocks"]),
            str(fam["rank"]),
            f"{fam['error']:.4f}",
            f"{stored / dense:.3f}",
        ]
        if quant:
            row += [f"{nbytes:,}", f"{nbytes / dense_bytes:.3f}"]
        table.add_row(*row)
    total = ["total", "", "", "", "", f"{total_stored / total_dense:.3f}"]
    if quant:
        total += [f"{total_bytes:,}", f"{total_bytes / total_dense_bytes:.3f}"]
    table.add_row(*total, style="bold")
    return table


def family_bytes(fam: dict) -> tuple[int, int]:
    """A family's stored bytes (its manifest's ``stored_bytes`` when it records them, else its
    parameters at its dtype) and its dense bytes at the source dtype."""
    from attnquant_core import dtype_from_name

    size = dtype_from_name(fam["dtype"]).itemsize
    source = dtype_from_name(fam.get("source_dtype", fam["dtype"])).itemsize
    stored = fam.get("stored_bytes", fam["stored_parameters"] * size)
    return int(stored), int(fam["dense_parameters"] * source)


def say_calibrated(output: Path) -> None:
    """One line on stderr when OUTPUT was fit for the output error (from its manifest)."""
    import json

    from attnquant_core import MANIFEST_FILE

    record = json.loads((output / MANIFEST_FILE).read_text()).get("calibration")
    if record:
        console.print(
            f"fit for the output error over {record['tokens']} calibration tokens "
            f"({record['whitened']} projections whitened, {record['unwhitened']} not; "
            f"{record['path']}, {record['digest'][:19]}); "
            f"measured errors in the table are of the weights",
            highlight=False,
            soft_wrap=True,
        )


def budget_table(report: BudgetReport, *, title: str) -> Table:
    """Per family: form, bands, ranks, size, error and why; the totals; the SVD baseline.

    A budget counted in bytes (``--quant``) shows each family's stored bytes and bytes over
    dense bytes (the budget's currency) instead of parameters, which say little of a 4-bit
    ``W0`` (its 4.5-bit weights count one each)."""
    in_bytes = report.currency == "bytes"
    columns = ["family", "form", "bands", "ranks min-max (mean)"]
    columns += ["stored bytes", "bytes / dense"] if in_bytes else ["stored / dense"]
    table = Table(title=title, show_lines=False)
    for col in [*columns, "rel. error"]:
        table.add_column(col, justify="left" if col in ("family", "form") else "right")
    table.add_column("why", justify="left", overflow="fold")

    def size(
        stored: int, dense: int, stored_bytes: int | None, dense_bytes: int | None
    ) -> list[str]:
        if not in_bytes:
            return [f"{stored / dense:.3f}"]
        assert stored_bytes is not None and dense_bytes is not None
        return [f"{stored_bytes:,}", f"{stored_bytes / dense_bytes:.3f}"]

    for name, c in report.families.items():
        error = c.measured_error if c.measured_error is not None else c.error
        form = c.form if c.side is None else f"{c.form} ({c.side})"
        table.add_row(
            name,
            form if c.quant is None else f"{form}, W0 {c.quant}",
            "-" if c.blocks is None else str(c.blocks),
            f"{min(c.ranks)}-{max(c.ranks)} ({sum(c.ranks) / len(c.ranks):.1f})",
            *size(c.stored, c.dense, c.stored_bytes, c.dense_bytes),
            f"{error:.4f}",
            c.why,
        )
    measured = report.measured_error
    table.add_row(
        "total",
        "",
        "",
        "",
        *size(report.stored, report.dense, report.stored_bytes, report.dense_bytes),
        f"{measured if measured is not None else report.error:.4f}",
        "no mix of forms beat per-layer SVD: this is the baseline" if report.used_baseline else "",
        style="bold",
    )
    if report.baseline:
        baseline_bytes = (
            sum(c.stored_bytes or 0 for c in report.baseline.values()) if in_bytes else None
        )
        table.add_row(
            "per-layer SVD",
            "lowrank",
            "-",
            "global ranks",
            *size(report.baseline_stored, report.dense, baseline_bytes, report.dense_bytes),
            f"{report.baseline_error:.4f}",
            "the baseline at the same budget (error predicted from singular values)",
            style="dim",
        )
    return table
