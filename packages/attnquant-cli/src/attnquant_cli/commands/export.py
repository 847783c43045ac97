"""``attnquant export``: the rebuilt weights of a checkpoint in Model Optimizer's NVFP4 layout
(attnquant-core, numpy: no MAX needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from attnquant_core.io import ExportProgress, export_nvfp4

from ._shared import JsonFlag, checkpoint_path, console, out, print_json

__all__ = ["export"]


def export(
    ckpt: Annotated[str, typer.Argument(help="Theta or dense checkpoint directory (or 'demo').")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Checkpoint to write.")],
    format: Annotated[str, typer.Option("--format", help="Output format: nvfp4.")] = "nvfp4",
    input_scale: Annotated[
        float, typer.Option(min=0.0, help="Static per-tensor activation scale (no calibration).")
    ] = 1.0,
    overwrite: Annotated[bool, typer.Option(help="Replace OUTPUT if it exists.")] = False,
    json_summary: JsonFlag = False,
) -> None:
    """Export the rebuilt weights of CKPT in Model Optimizer's NVFP4 layout."""
    if format != "nvfp4":
        raise typer.BadParameter(f"--format {format!r}: only 'nvfp4' is supported")
    src = checkpoint_path(ckpt)
    with Progress(
        TextColumn("{task.description:<18}"), BarColumn(), MofNCompleteColumn(), console=console
    ) as progress:
        task = progress.add_task("export", total=None)

        def report(event: ExportProgress) -> None:
            progress.update(task, completed=event.done, total=event.total)

        summary = export_nvfp4(
            src, output, input_scale=input_scale, overwrite=overwrite, progress=report
        )
    if json_summary:
        print_json({"output": str(output), "format": format, **summary})
        return
    out.print(
        f"{output}: {summary['quantized']} projections in NVFP4, {summary['copied']} tensors "
        f"copied; projection bytes {summary['packed_bytes']:,} (float32: "
        f"{summary['float32_bytes']:,}, {summary['float32_bytes'] / summary['packed_bytes']:.2f}x); "
        f"max relative error {summary['max_rel_error']:.4f}",
        highlight=False,
    )
