"""``attnquant decompose --calibration-data``: calibrate in the same pass, fit sequentially.

The text is read and tokenised exactly as ``attnquant calibrate --data`` reads it
(:func:`calibration_windows`); attnquant-core's :func:`decompose_calibrated` then runs the
numpy forward and fits, sequentially (each layer against the compressed model's own inputs,
the default) or not (the whitened fit of ``--calibration``, on statistics made in the pass).
"""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from attnquant_core import DecomposeSpec
from attnquant_core.calib import decompose_calibrated, open_source
from attnquant_core.llama_reference import ReferenceConfigError

from ._calibrate import calibration_windows, layer_progress
from ._console import Output

__all__ = ["decompose_with_data"]

console = Output(stderr=True)
out = Output()


def decompose_with_data(
    src: Path, output: Path, spec: DecomposeSpec, *, overwrite: bool, quiet: bool
) -> dict:
    """Tokenise the spec's ``calibration_data``, calibrate ``src`` on it and decompose to
    ``output``; print a table.

    The spec (checked when made) gives the windows' count and length and whether the fit is
    sequential (by default it is: the numpy forward runs every checkpoint it can calibrate).
    Returns the manifest.
    """
    data = list(spec.calibration_data or ())
    try:
        source = open_source(src)
    except ReferenceConfigError as exc:
        if spec.sequential:
            raise ReferenceConfigError(f"--sequential: {exc}") from None
        raise
    windows = calibration_windows(
        source,
        data,
        samples=spec.effective_samples,
        seq_len=spec.effective_seq_len,
        seed=0,
    )
    with layer_progress() as progress:
        tasks: dict[str, object] = {}

        def report(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = progress.add_task(stage, total=total)
            progress.update(tasks[stage], completed=done)  # type: ignore[arg-type]

        manifest = decompose_calibrated(
            source,
            windows,
            output,
            spec=spec,
            data=[str(p) for p in data],
            progress=report,
            overwrite=overwrite,
        )
    (console if quiet else out).print_table(_table(manifest, output))
    record = manifest["calibration"]
    console.print(
        f"fit for the output error over {record['tokens']} calibration tokens of "
        f"{', '.join(record['data'])} ({record['data_digest'][:19]}), "
        + (
            "sequentially: each layer against the compressed model's own inputs"
            + (f"; {record['allocation']}" if record.get("allocation") else "")
            if record["sequential"]
            else "not sequentially (--no-sequential): whitened by the dense model's inputs"
        )
        + "; measured errors in the table are of the weights",
        highlight=False,
        soft_wrap=True,
    )
    return manifest


def _table(manifest: dict, output: Path) -> Table:
    """Per family: form, ranks, weight error, mean output error, stored / dense."""
    title = f"{output}  ({'sequential' if manifest['calibration']['sequential'] else 'whitened'})"
    table = Table(title=title)
    for col in ("family", "form", "ranks", "rel. error", "output error", "stored / dense"):
        table.add_column(col, justify="left" if col in ("family", "form") else "right")
    stored = dense = 0
    for name, fam in manifest["families"].items():
        stored += fam["stored_parameters"]
        dense += fam["dense_parameters"]
        outs = [e for e in fam.get("output_errors") or [] if e is not None]
        ranks = fam["ranks"]
        table.add_row(
            name,
            fam["form"] + (f" ({fam['side']})" if fam.get("side") else ""),
            str(ranks[0]) if len(set(ranks)) == 1 else f"{min(ranks)}-{max(ranks)}",
            f"{fam['error']:.4f}",
            f"{sum(outs) / len(outs):.4f}" if outs else "-",
            f"{fam['stored_parameters'] / fam['dense_parameters']:.3f}",
        )
    table.add_row("total", "", "", "", "", f"{stored / dense:.3f}", style="bold")
    return table
