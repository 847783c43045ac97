"""``attnquant decompose --calibration-data``: calibrate in the same pass, fit sequentially.

The text is read and tokenised exactly as ``attnquant calibrate --data`` reads it
(:func:`calibration_windows`); attnquant-core's :func:`decompose_calibrated` then runs the
numpy forward and fits, sequentially (each layer against the compressed model's own inputs,
the default) or not (the whitened fit of ``--calibration``, on statistics made in the pass).
"""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from attnquant_core import DecompositionError
from attnquant_core.calib import (
    DEFAULT_SAMPLES,
    DEFAULT_SEQ_LEN,
    decompose_calibrated,
    open_source,
)
from attnquant_core.llama_reference import ReferenceConfigError

from ._calibrate import calibration_windows, layer_progress
from ._console import Output

__all__ = ["check_calibration_options", "decompose_with_data"]

console = Output(stderr=True)
out = Output()


def check_calibration_options(
    *,
    calibration: Path | None,
    calibration_data: list[Path] | None,
    sequential: bool | None,
    samples: int | None,
    seq_len: int | None,
    align: bool,
) -> None:
    """Refuse, in one line and before anything is written, options that do not go together."""
    if calibration is not None and calibration_data:
        raise DecompositionError(
            "--calibration STATS and --calibration-data PATH: give one (statistics made "
            "elsewhere, or text to calibrate on in the same pass)"
        )
    if sequential and not calibration_data:
        raise DecompositionError(
            "--sequential needs --calibration-data PATH...: it runs the compressed model over "
            "that text (statistics alone have no inputs to run)"
        )
    if (samples is not None or seq_len is not None) and not calibration_data:
        raise DecompositionError("--samples/--seq-len apply to --calibration-data only")
    if calibration_data and align:
        raise DecompositionError(
            "--calibration-data with --align: the calibration runs the original layers, not "
            "the aligned ones; drop one of them"
        )


def decompose_with_data(
    src: Path,
    output: Path,
    data: list[Path],
    *,
    blocks: str | None,
    rank: int | None,
    budget: float | None,
    sequential: bool | None,
    samples: int | None,
    seq_len: int | None,
    overwrite: bool,
    quiet: bool,
) -> dict:
    """Tokenise ``data``, calibrate ``src`` on it and decompose to ``output``; print a table.

    ``sequential=None`` is sequential (the numpy forward runs every checkpoint it can
    calibrate). Returns the manifest.
    """
    try:
        source = open_source(src)
    except ReferenceConfigError as exc:
        if sequential:
            raise ReferenceConfigError(f"--sequential: {exc}") from None
        raise
    windows = calibration_windows(
        source,
        list(data),
        samples=DEFAULT_SAMPLES if samples is None else samples,
        seq_len=DEFAULT_SEQ_LEN if seq_len is None else seq_len,
        seed=0,
    )
    seq = True if sequential is None else sequential
    if budget is None and blocks is None and rank is None:
        blocks_arg: int | str | None = 1
    else:
        blocks_arg = None if blocks is None else _blocks(blocks)
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
            sequential=seq,
            budget=budget,
            blocks=None if budget is not None else blocks_arg,
            rank=rank if budget is None else None,
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


def _blocks(text: str) -> int | str:
    text = text.strip().lower()
    if text == "layers":
        return text
    try:
        return int(text)
    except ValueError:
        raise DecompositionError(f"--blocks {text!r}: give a number of bands or 'layers'") from None


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
