"""``attnquant decompose``: every projection family of a checkpoint into a theta checkpoint.

The options become one :class:`attnquant_core.DecomposeSpec`, which checks them (and holds
their defaults) once; the spec then goes to alignment, the calibration pass and the fit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from attnquant_core import DecomposeSpec, decompose_checkpoint
from attnquant_core.fit import (
    ALLOCATIONS,
    DEFAULT_ALLOCATION,
    DEFAULT_BLOCKS,
    DEFAULT_QUANT_BLOCKS,
    DEFAULT_RANK,
    DEFAULT_ROUNDING,
    DEFAULT_SAMPLES,
    DEFAULT_SEQ_LEN,
    DEFAULT_SEQUENTIAL,
)

from .._decompose_data import decompose_with_data
from ._decompose_report import (
    budget_table,
    fixed_table,
    print_json_summary,
    say_calibrated,
)
from ._shared import JsonFlag, checkpoint_path, console, out, progress_bars, reporter

__all__ = ["decompose"]


def decompose(
    ckpt: Annotated[Path, typer.Argument(help="Hugging Face checkpoint directory (or 'demo').")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Theta checkpoint to write.")],
    blocks: Annotated[
        str | None,
        typer.Option(
            help="Shared blocks G per family, or 'layers' (passthrough). "
            f"[default: {DEFAULT_BLOCKS}]"
        ),
    ] = None,
    rank: Annotated[
        int | None,
        typer.Option(min=0, help=f"Rank r of the per-layer correction. [default: {DEFAULT_RANK}]"),
    ] = None,
    budget: Annotated[
        str | None,
        typer.Option(
            help="Stored/dense parameters in (0, 1]: choose each family's form and every "
            "layer's rank for the least total error at that size (excludes --blocks/--rank). "
            "With --quant: stored/dense bytes, a 4-bit banded W0 competing with the float forms."
        ),
    ] = None,
    align: Annotated[
        bool,
        typer.Option(
            help="First align each family's layers to their band mean (one band for --budget "
            "and at passthrough) by function-preserving permutations and rotations (Llama-style "
            "models); the transforms are recorded in OUTPUT/attnquant-align.{json,npz}."
        ),
    ] = False,
    calibration: Annotated[
        Path | None,
        typer.Option(
            help="Calibration statistics (from `attnquant calibrate` or any tool writing the "
            "public format): fit every form for the output error ||(W - W_hat) X|| over the "
            "calibration inputs instead of the weight error."
        ),
    ] = None,
    calibration_data: Annotated[
        list[Path] | None,
        typer.Option(
            "--calibration-data",
            help="Calibration text (as `attnquant calibrate --data`; repeat for more): "
            "calibrate in the same pass and fit for the output error.",
        ),
    ] = None,
    samples: Annotated[
        int | None,
        typer.Option(min=1, help=f"--calibration-data: sequences. [default: {DEFAULT_SAMPLES}]"),
    ] = None,
    seq_len: Annotated[
        int | None,
        typer.Option(
            min=2, help=f"--calibration-data: tokens per sequence. [default: {DEFAULT_SEQ_LEN}]"
        ),
    ] = None,
    sequential: Annotated[
        bool | None,
        typer.Option(
            "--sequential/--no-sequential",
            help="With --calibration-data: fit each layer against the inputs the already "
            "compressed layers produce (SVD-LLM V2 / Basis Sharing). "
            f"[default: {'on' if DEFAULT_SEQUENTIAL else 'off'}]",
        ),
    ] = None,
    quant: Annotated[
        str | None,
        typer.Option(
            help="Store each band's W0 in 4 bits: 'nvfp4' (NVIDIA Model Optimizer's layout, "
            "4.5 bits a weight); s and the rank-r correction are fitted to what the 4-bit W0 "
            "misses (whitened with --calibration). Needs every input dimension a multiple of 16; "
            f"--blocks then defaults to {DEFAULT_QUANT_BLOCKS!r} (W0 = each layer's own weight). "
            "With --budget, each family may take it where it lowers the error, and the budget "
            "counts bytes."
        ),
    ] = None,
    rounding: Annotated[
        str,
        typer.Option(
            help="With --quant and --calibration: how each 4-bit W0 is rounded where the "
            "statistics cover its band: 'gptq' (GPTQ's error-compensated rounding for the "
            "band's inputs) or 'nearest' (round to nearest, as without statistics)."
        ),
    ] = DEFAULT_ROUNDING,
    allocation: Annotated[
        str | None,
        typer.Option(
            help="With --budget and calibration: how the budget is split between the "
            "projections: 'global' (by whitened error drop per parameter) or 'sensitivity' "
            "(each projection's output error weighed by the KL it costs the model, measured on "
            "calibration text: by `attnquant calibrate --sensitivity` beside --calibration "
            "STATS, or in the pass of --calibration-data). [default: sensitivity where "
            f"--calibration STATS has them beside it, else {DEFAULT_ALLOCATION}; "
            f"one of {', '.join(ALLOCATIONS)}]"
        ),
    ] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace OUTPUT if it exists.")] = False,
    json_summary: JsonFlag = False,
) -> None:
    """Decompose every projection family of CKPT into a theta checkpoint."""
    src = checkpoint_path(ckpt)
    spec = DecomposeSpec(  # every option checked here, in one line, before anything is written
        blocks=blocks,
        rank=rank,
        budget=budget,
        align=align,
        calibration=calibration,
        calibration_data=calibration_data,
        samples=samples,
        seq_len=seq_len,
        sequential=sequential,
        quant=quant,
        rounding=rounding,
        allocation=allocation,
        spelling="cli",
    )
    if output.exists() and not overwrite:
        raise FileExistsError(f"{output} already exists; remove it or pass --overwrite")
    if spec.calibration_data:
        decompose_with_data(src, output, spec, overwrite=overwrite, quiet=json_summary)
    elif spec.align:
        _align_and_decompose(src, output, spec, overwrite=overwrite, quiet=json_summary)
    else:
        decompose_to(src, output, spec, overwrite=overwrite, quiet=json_summary)
    print_json_summary(output, json_summary)


def _align_and_decompose(
    src: Path, output: Path, spec: DecomposeSpec, *, overwrite: bool, quiet: bool
) -> None:
    """``--align``: align a temporary copy of SRC to its band means, then decompose that copy."""
    import tempfile

    from attnquant_core import align_checkpoint

    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{output.name}.align-", dir=output.parent) as tmp:
        # Align to the bands the decomposition will use; one band (G = 1) for a budget fit
        # and at passthrough, where bands of one layer would leave nothing to align.
        plain = spec.blocks is None or spec.budget is not None or spec.blocks == "layers"
        G: int | str = 1 if plain else spec.blocks  # type: ignore[assignment]
        console.print(f"aligning {src} to its band means (G={G}) ...")
        report = align_checkpoint(src, Path(tmp) / "aligned", blocks=G)
        table = Table(title="alignment: relative distance of the layers to their band mean")
        for col in ("family", "before", "after", "after / before"):
            table.add_column(col, justify="left" if col == "family" else "right")
        for name, (before, after) in report.distances.items():
            ratio = after / before if before > 0 else 1.0
            table.add_row(name, f"{before:.4f}", f"{after:.4f}", f"{ratio:.3f}")
        (console if quiet else out).print_table(table)
        for note in report.notes:
            console.print(f"note: {note}")
        # Core names SRC as the source and records the alignment in OUTPUT's manifest.
        decompose_to(report.path, output, spec, overwrite=overwrite, quiet=quiet, aligned_from=src)


def decompose_to(
    src: Path,
    output: Path,
    spec: DecomposeSpec,
    *,
    overwrite: bool,
    quiet: bool = False,
    aligned_from: Path | None = None,
) -> None:
    """Fit to the spec's budget, or band every family; print the summary table on stdout (on
    stderr when ``quiet``: ``--json`` keeps stdout for the JSON). ``aligned_from``: ``src`` is
    an aligned copy of it (recorded in the manifest by core)."""
    if spec.budget is not None:
        _fit_budget(src, output, spec, overwrite=overwrite, quiet=quiet, aligned_from=aligned_from)
        say_calibrated(output)
        return
    with progress_bars() as progress:
        manifest = decompose_checkpoint(
            src,
            output,
            spec=spec,  # a 4-bit band mean is a poor W0: with --quant, no --blocks is passthrough
            progress=reporter(progress),
            overwrite=overwrite,
            aligned_from=aligned_from,
        )
    (console if quiet else out).print_table(fixed_table(manifest, output, spec.quant))
    say_calibrated(output)


def _fit_budget(
    src: Path,
    output: Path,
    spec: DecomposeSpec,
    *,
    overwrite: bool,
    quiet: bool,
    aligned_from: Path | None,
) -> None:
    """``decompose --budget``: fit, then say per family what was chosen and why."""
    from attnquant_core import decompose_budget

    with progress_bars() as progress:
        report = decompose_budget(
            src,
            output,
            spec=spec,
            progress=reporter(progress),
            overwrite=overwrite,
            aligned_from=aligned_from,
        )
    quant = spec.quant
    what = "auto form" if quant is None else f"auto form, bytes, W0 {quant} allowed"
    allocation = ((report.manifest or {}).get("budget") or {}).get("allocation")
    if allocation is not None:  # the one used (unset: sensitivity where measured)
        what += f", {allocation} allocation"
    table = budget_table(report, title=f"{output}  (budget {spec.budget:g}, {what})")
    (console if quiet else out).print_table(table)
