"""The ``attnquant`` command: composes attnquant-core (numpy) and attnquant-max (MAX).

MAX is imported lazily, inside the commands that need it, so ``attnquant --help`` and the
numpy-only commands start instantly.
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from attnquant_core import (
    AttnquantError,
    DecomposeProgress,
    DecompositionError,
    decompose_checkpoint,
)

from ._calibrate import calibrate
from ._check import check
from ._console import Output
from ._decompose_data import check_calibration_options, decompose_with_data
from ._demo import demo_model_path
from ._eval import evaluate_command
from ._prompts import VERIFY_PROMPTS

if TYPE_CHECKING:
    from attnquant_core import BudgetReport

__all__ = ["app", "cli", "main"]

app = typer.Typer(
    name="attnquant",
    help="Compress decoder LLM projections into theta bundles and serve them through MAX.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Output(stderr=True)
out = Output()
app.command()(check)  # attnquant check CKPT: tensor digests (_check.py)
app.command()(calibrate)  # attnquant calibrate CKPT -o STATS: input grams (_calibrate.py)
app.command(name="eval")(evaluate_command)  # attnquant eval BASE [THETA...] (_eval.py)

JsonFlag = Annotated[
    bool,
    typer.Option(
        "--json", help="Print the figures as one JSON object on stdout (tables go to stderr)."
    ),
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


@app.callback()
def _root() -> None:
    """Compress decoder LLM projections into theta bundles and serve them through MAX."""


def _budget_value(text: str) -> float:
    """``--budget`` as a float in (0, 1], else a one-line error naming the option."""
    from attnquant_core import check_budget

    try:
        value = float(text)
    except ValueError:
        raise DecompositionError(
            f"--budget {text!r} is not a number; give stored/dense parameters in (0, 1], e.g. 0.5"
        ) from None
    try:
        return check_budget(value)
    except DecompositionError:
        raise DecompositionError(
            f"--budget {text}: must be in (0, 1] (stored parameters over dense parameters of "
            f"the projections; 0.5 keeps half)"
        ) from None


def _progress_bars() -> Progress:
    return Progress(
        TextColumn("{task.description:<26}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("err {task.fields[error]:.4f}"),
        TimeElapsedColumn(),
        console=console,
    )


def _reporter(progress: Progress) -> Callable[[DecomposeProgress], None]:
    tasks: dict[tuple[str, str], TaskID] = {}

    def report(event: DecomposeProgress) -> None:
        key = (event.family, event.stage)
        if key not in tasks:
            what = event.family if event.stage == "fit" else f"{event.family} ({event.stage})"
            tasks[key] = progress.add_task(what, total=event.num_layers, error=0.0)
        error = event.error if event.error == event.error else 0.0  # NaN while measuring
        progress.update(tasks[key], advance=1, error=error)

    return report


@app.command()
def decompose(
    ckpt: Annotated[Path, typer.Argument(help="Hugging Face checkpoint directory (or 'demo').")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Theta checkpoint to write.")],
    blocks: Annotated[
        str | None,
        typer.Option(help="Shared blocks G per family, or 'layers' (passthrough). [default: 1]"),
    ] = None,
    rank: Annotated[
        int | None, typer.Option(min=0, help="Rank r of the per-layer correction. [default: 16]")
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
        typer.Option(min=1, help="--calibration-data: sequences. [default: 128]"),
    ] = None,
    seq_len: Annotated[
        int | None,
        typer.Option(min=2, help="--calibration-data: tokens per sequence. [default: 512]"),
    ] = None,
    sequential: Annotated[
        bool | None,
        typer.Option(
            "--sequential/--no-sequential",
            help="With --calibration-data: fit each layer against the inputs the already "
            "compressed layers produce (SVD-LLM V2 / Basis Sharing). [default: on]",
        ),
    ] = None,
    quant: Annotated[
        str | None,
        typer.Option(
            help="Store each band's W0 in 4 bits: 'nvfp4' (NVIDIA Model Optimizer's layout, "
            "4.5 bits a weight); s and the rank-r correction are fitted to what the 4-bit W0 "
            "misses (whitened with --calibration). Needs every input dimension a multiple of 16; "
            "--blocks then defaults to 'layers' (W0 = each layer's own weight). With --budget, "
            "each family may take it where it lowers the error, and the budget counts bytes."
        ),
    ] = None,
    rounding: Annotated[
        str,
        typer.Option(
            help="With --quant and --calibration: how each 4-bit W0 is rounded where the "
            "statistics cover its band: 'gptq' (GPTQ's error-compensated rounding for the "
            "band's inputs) or 'nearest' (round to nearest, as without statistics)."
        ),
    ] = "gptq",
    overwrite: Annotated[bool, typer.Option(help="Replace OUTPUT if it exists.")] = False,
    json_summary: JsonFlag = False,
) -> None:
    """Decompose every projection family of CKPT into a theta checkpoint."""
    src = demo_model_path() if str(ckpt) == "demo" else ckpt
    _check_quant_options(quant, calibration_data=calibration_data, rounding=rounding)
    check_calibration_options(
        calibration=calibration,
        calibration_data=calibration_data,
        sequential=sequential,
        samples=samples,
        seq_len=seq_len,
        align=align,
    )
    if calibration is not None and align:
        raise DecompositionError(
            "--calibration with --align: the statistics are of the original layers, not the "
            "aligned ones; drop one of them"
        )
    if budget is not None and (blocks is not None or rank is not None):
        raise DecompositionError(
            "--budget chooses every family's form, bands and ranks; "
            "give either --budget or --blocks/--rank, not both"
        )
    value = None if budget is None else _budget_value(budget)
    if output.exists() and not overwrite:
        raise FileExistsError(f"{output} already exists; remove it or pass --overwrite")
    if calibration_data:
        decompose_with_data(
            src,
            output,
            calibration_data,
            blocks=blocks,
            rank=rank,
            budget=value,
            sequential=sequential,
            samples=samples,
            seq_len=seq_len,
            overwrite=overwrite,
            quiet=json_summary,
        )
        _print_json_summary(output, json_summary)
        return
    if not align:
        _decompose(
            src,
            output,
            blocks,
            rank,
            value,
            overwrite=overwrite,
            quiet=json_summary,
            calibration=calibration,
            quant=quant,
            rounding=rounding,
        )
        _print_json_summary(output, json_summary)
        return
    import tempfile

    from attnquant_core import align_checkpoint

    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{output.name}.align-", dir=output.parent) as tmp:
        # Align to the bands the decomposition will use; one band (G = 1) for a budget fit
        # and at passthrough, where bands of one layer would leave nothing to align.
        plain = blocks is None or value is not None or blocks.strip().lower() == "layers"
        G: int | str = 1 if plain else blocks
        console.print(f"aligning {src} to its band means (G={G}) ...")
        report = align_checkpoint(src, Path(tmp) / "aligned", blocks=G)
        table = Table(title="alignment: relative distance of the layers to their band mean")
        for col in ("family", "before", "after", "after / before"):
            table.add_column(col, justify="left" if col == "family" else "right")
        for name, (before, after) in report.distances.items():
            ratio = after / before if before > 0 else 1.0
            table.add_row(name, f"{before:.4f}", f"{after:.4f}", f"{ratio:.3f}")
        (console if json_summary else out).print_table(table)
        for note in report.notes:
            console.print(f"note: {note}")
        # Core names SRC as the source and records the alignment in OUTPUT's manifest.
        _decompose(
            report.path,
            output,
            blocks,
            rank,
            value,
            overwrite=overwrite,
            quiet=json_summary,
            aligned_from=src,
            quant=quant,
        )
    _print_json_summary(output, json_summary)


def _check_quant_options(
    quant: str | None, *, calibration_data: list[Path] | None, rounding: str = "gptq"
) -> None:
    """Refuse, in one line and before anything is written, a ``--quant`` that cannot be done."""
    from attnquant_core.fit import ROUNDINGS

    if rounding not in ROUNDINGS:
        raise DecompositionError(f"--rounding {rounding!r}: choose one of {', '.join(ROUNDINGS)}")
    if quant is None:
        return
    from attnquant_core import QUANTS

    if quant not in QUANTS:
        raise DecompositionError(f"--quant {quant!r}: choose one of {', '.join(QUANTS)}")
    if calibration_data:
        raise DecompositionError(
            "--quant with --calibration-data: not supported yet; run `attnquant calibrate` "
            "first and pass its statistics with --calibration"
        )


def _print_json_summary(output: Path, wanted: bool) -> None:
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
        summary["stored_bytes"] = sum(_family_bytes(f)[0] for f in manifest["families"].values())
        summary["dense_bytes"] = sum(_family_bytes(f)[1] for f in manifest["families"].values())
    if "budget" in manifest:
        summary["budget"] = manifest["budget"]
    if "calibration" in manifest:
        summary["calibration"] = manifest["calibration"]
    _print_json(summary)


def _print_json(payload: object) -> None:
    import json

    sys.stdout.write(json.dumps(payload) + "\n")


def _decompose(
    src: Path,
    output: Path,
    blocks: str | None,
    rank: int | None,
    budget: float | None,
    *,
    overwrite: bool,
    quiet: bool = False,
    aligned_from: Path | None = None,
    calibration: Path | None = None,
    quant: str | None = None,
    rounding: str = "gptq",
) -> None:
    """Fit to ``budget``, or band every family with ``blocks``/``rank``; print the summary
    table on stdout (on stderr when ``quiet``: ``--json`` keeps stdout for the JSON).
    ``aligned_from``: ``src`` is an aligned copy of it (recorded in the manifest by core)."""
    if budget is not None:
        _decompose_budget(
            src,
            output,
            budget,
            overwrite=overwrite,
            quiet=quiet,
            aligned_from=aligned_from,
            calibration=calibration,
            quant=quant,
            rounding=rounding,
        )
        _say_calibrated(output)
        return
    with _progress_bars() as progress:
        manifest = decompose_checkpoint(
            src,
            output,
            # A 4-bit band mean is a poor W0: with --quant, no --blocks means passthrough.
            blocks=("layers" if quant else "1") if blocks is None else blocks,
            rank=16 if rank is None else rank,
            progress=_reporter(progress),
            overwrite=overwrite,
            aligned_from=aligned_from,
            calibration=calibration,
            quant=quant,
            rounding=rounding,
        )
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
        nbytes, dense_bytes = _family_bytes(fam)
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
    (console if quiet else out).print_table(table)
    _say_calibrated(output)


def _family_bytes(fam: dict) -> tuple[int, int]:
    """A family's stored bytes (its manifest's ``stored_bytes`` when it records them, else its
    parameters at its dtype) and its dense bytes at the source dtype."""
    from attnquant_core import dtype_from_name

    size = dtype_from_name(fam["dtype"]).itemsize
    source = dtype_from_name(fam.get("source_dtype", fam["dtype"])).itemsize
    stored = fam.get("stored_bytes", fam["stored_parameters"] * size)
    return int(stored), int(fam["dense_parameters"] * source)


def _say_calibrated(output: Path) -> None:
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


def _decompose_budget(
    src: Path,
    output: Path,
    budget: float,
    *,
    overwrite: bool,
    quiet: bool = False,
    aligned_from: Path | None = None,
    calibration: Path | None = None,
    quant: str | None = None,
    rounding: str = "gptq",
) -> None:
    """``decompose --budget``: fit, then say per family what was chosen and why."""
    from attnquant_core import decompose_budget

    with _progress_bars() as progress:
        report = decompose_budget(
            src,
            output,
            budget=budget,
            progress=_reporter(progress),
            overwrite=overwrite,
            aligned_from=aligned_from,
            calibration=calibration,
            quant=quant,
            rounding=rounding,
        )
    what = "auto form" if quant is None else f"auto form, bytes, W0 {quant} allowed"
    table = budget_table(report, title=f"{output}  (budget {budget:g}, {what})")
    (console if quiet else out).print_table(table)


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


@app.command()
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
    from attnquant_max import ExportProgress, export_nvfp4

    if format != "nvfp4":
        raise typer.BadParameter(f"--format {format!r}: only 'nvfp4' is supported")
    src = demo_model_path() if ckpt == "demo" else Path(ckpt)
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
        _print_json({"output": str(output), "format": format, **summary})
        return
    out.print(
        f"{output}: {summary['quantized']} projections in NVFP4, {summary['copied']} tensors "
        f"copied; projection bytes {summary['packed_bytes']:,} (float32: "
        f"{summary['float32_bytes']:,}, {summary['float32_bytes'] / summary['packed_bytes']:.2f}x); "
        f"max relative error {summary['max_rel_error']:.4f}",
        highlight=False,
    )


def _int_list(text: str, what: str) -> list[int | str]:
    items: list[int | str] = []
    for part in text.split(","):
        part = part.strip()
        if part == "layers" and what == "blocks":
            items.append(part)
            continue
        try:
            items.append(int(part))
        except ValueError:
            raise typer.BadParameter(f"--{what}: {part!r} is not an integer") from None
    return items


@app.command()
def analyze(
    ckpt: Annotated[str, typer.Argument(help="Hugging Face checkpoint directory (or 'demo').")],
    blocks: Annotated[
        str, typer.Option(help="Comma-separated G values ('layers' allowed).")
    ] = "1,2",
    rank: Annotated[str, typer.Option(help="Comma-separated ranks r.")] = "0,8,32",
    budget: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated budgets in (0, 1] (stored/dense parameters): add the auto "
            "form's frontier beside per-layer SVD with globally allocated ranks."
        ),
    ] = None,
    output: Annotated[
        Path, typer.Option("--output", "-o", help="Directory for analyze.{csv,json,png}.")
    ] = Path("attnquant-analyze"),
    calibration: Annotated[
        Path | None,
        typer.Option(
            help="Calibration statistics (public format): add the relative output error "
            "||(W - W_hat) X|| / ||W X|| of every form fit for it, and the frontier fit for it; "
            "families without statistics keep the weight error only."
        ),
    ] = None,
) -> None:
    """Sweep G x r: error against compression, beside per-layer SVD at the same size."""
    from attnquant_core import budget_frontier, open_checkpoint, sweep
    from attnquant_core.calib import read_stats
    from attnquant_core.fit import coverage_record

    from ._analyze import (
        frontier_table,
        sweep_table,
        write_atomic,
        write_csv,
        write_json,
        write_plot,
    )

    src = demo_model_path() if ckpt == "demo" else Path(ckpt)
    Gs, ranks = _int_list(blocks, "blocks"), _int_list(rank, "rank")
    budgets = [_budget_value(b.strip()) for b in budget.split(",")] if budget is not None else []
    checkpoint = open_checkpoint(src)
    stats = None if calibration is None else read_stats(calibration)
    if stats is not None:
        coverage_record(checkpoint, stats)  # statistics of another model: refused up front
    with Progress(
        TextColumn("{task.description:<30}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        task = progress.add_task("sweep", total=len(checkpoint.families) * len(Gs))

        def step(what: str) -> None:
            progress.update(task, advance=1, description=what)

        result = sweep(
            checkpoint,
            blocks=Gs,  # type: ignore[arg-type]
            ranks=ranks,  # type: ignore[arg-type]
            progress=step,
            calibration=stats,
        )
        frontier = output_frontier = None
        for cal in [None, stats] if budgets and stats is not None else [None] if budgets else []:
            spectra = progress.add_task(
                "budget spectra" if cal is None else "whitened spectra",
                total=len(checkpoint.families) * checkpoint.num_layers,
            )
            points = budget_frontier(
                checkpoint,
                budgets,
                progress=lambda event, task=spectra: progress.update(
                    task, advance=1, description=f"spectra {event.family}"
                ),
                calibration=cal,
            )
            if cal is None:
                frontier = points
            else:
                output_frontier = points
    output.mkdir(parents=True, exist_ok=True)
    title = f"{src.name}: error against compression"
    frontiers = dict(frontier=frontier, output_frontier=output_frontier)
    write_atomic(output / "analyze.csv", lambda p: write_csv(result, p, **frontiers))
    write_atomic(
        output / "analyze.json",
        lambda p: write_json(result, p, checkpoint=str(src), **frontiers),
    )
    write_atomic(output / "analyze.png", lambda p: write_plot(result, p, title=title, **frontiers))
    out.print_table(sweep_table(result, title))
    if frontier:
        out.print_table(frontier_table(frontier, f"{src.name}: budget frontier (auto form)"))
    if output_frontier:
        out.print_table(
            frontier_table(output_frontier, f"{src.name}: budget frontier fit for the output error")
        )
    if result.calibration is not None:
        console.print(f"calibration: {result.calibration['note']}", highlight=False)
    console.print(f"wrote {output}/analyze.csv, analyze.json, analyze.png", highlight=False)


def _model(model: str | None) -> Path:
    """The checkpoint a serving command acts on: the demo model when none (or 'demo') is given."""
    return demo_model_path() if model in (None, "demo") else Path(model)


ModelArg = Annotated[
    str | None,
    typer.Argument(
        help="Checkpoint directory, theta or dense; the embedded demo model if omitted."
    ),
]
MaxLength = Annotated[int, typer.Option(min=8, help="Longest prompt plus completion, in tokens.")]
MaxBatch = Annotated[int, typer.Option(min=1, help="Requests batched per forward pass.")]
Devices = Annotated[str, typer.Option(help="MAX devices: cpu, gpu, gpu:0,1.")]


@app.command()
def serve(
    model: ModelArg = None,
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port to listen on.")] = 8000,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    devices: Devices = "cpu",
    max_length: MaxLength = 512,
    max_batch_size: MaxBatch = 8,
    served_model_name: Annotated[
        str | None, typer.Option(help="Model name clients ask for (default: the directory name).")
    ] = None,
    echo: Annotated[
        bool,
        typer.Option(
            "--echo/--no-echo",
            help="Serve prompt log-probabilities (echo with logprobs, as evaluation harnesses "
            "ask); --no-echo refuses those requests with a 400.",
        ),
    ] = True,
    restarts: Annotated[
        int,
        typer.Option(min=0, help="Restarts of a dying MAX server allowed within 10 minutes."),
    ] = 5,
) -> int:
    """Serve MODEL behind an OpenAI-compatible endpoint through MAX (Ctrl-C stops it)."""
    from attnquant_core import require_intact
    from attnquant_max import plan_serving, serve_command, serve_env
    from attnquant_max._serve import check_port_free
    from attnquant_max.gateway import ECHO_SERVE_ARGS, run_gateway

    path = _model(model)
    env = serve_env()  # validates every ATTNQUANT_* variable before anything starts
    plan = plan_serving(path)  # validates a theta checkpoint's keys and bands
    check_port_free(host, port)  # one line now, not a MAX traceback after the model loads
    require_intact(path)  # every tensor against its digest (ATTNQUANT_VERIFY_DIGESTS=0: skip)
    name = served_model_name or ("demo" if model in (None, "demo") else path.name)
    console.print(plan.describe(), highlight=False, soft_wrap=True)
    console.print(
        f"OpenAI-compatible API at http://{host}:{port}/v1, model {name!r}; "
        f"prompt log-probabilities {'on' if echo else 'off (--no-echo)'}",
        highlight=False,
        soft_wrap=True,
    )

    def argv_for(backend_port: int) -> list[str]:
        return serve_command(
            path,
            port=backend_port,
            devices=devices,
            max_length=max_length,
            max_batch_size=max_batch_size,
            served_model_name=name,
            extra_args=ECHO_SERVE_ARGS if echo else (),
        )

    argv_for(0)  # refuses a model the device cannot run (Gemma on a CPU) before anything starts

    def terminated(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # SIGTERM shuts down as cleanly as Ctrl-C

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        code = run_gateway(
            path,
            host=host,
            port=port,
            name=name,
            max_length=max_length,
            echo=echo,
            argv_for=argv_for,
            env=env,
            log=lambda line: console.print(line, highlight=False, markup=False, soft_wrap=True),
            restarts=restarts,
        )
    except KeyboardInterrupt:
        code = 0
    finally:
        signal.signal(signal.SIGTERM, previous)
    console.print("attnquant: server stopped")
    return code


@app.command()
def generate(
    model: ModelArg = None,
    prompt: Annotated[str, typer.Option("--prompt", "-p", help="Text to complete.")] = "def ",
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Tokens to generate.")] = 64,
    devices: Devices = "cpu",
    max_length: MaxLength = 512,
    max_batch_size: MaxBatch = 8,
) -> int:
    """Complete PROMPT greedily with MODEL (raw completion, no chat template)."""
    from attnquant_core import require_intact
    from attnquant_max import greedy_generate, load_pipeline, plan_serving

    path = _model(model)
    require_intact(path)  # every tensor against its digest (ATTNQUANT_VERIFY_DIGESTS=0: skip)
    console.print(plan_serving(path).describe(), highlight=False, soft_wrap=True)
    with load_pipeline(
        path, max_length=max_length, max_batch_size=max_batch_size, devices=devices
    ) as loaded:
        ids = loaded.encode(prompt)
        new = greedy_generate(loaded, ids, max_new_tokens)
        out.print(prompt + loaded.decode(new), highlight=False, markup=False)
    return 0


@app.command()
def verify(
    base: Annotated[Path, typer.Argument(help="The base (dense) checkpoint, or 'demo'.")],
    theta: Annotated[Path, typer.Argument(help="The checkpoint to check: theta or dense.")],
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Greedy tokens per prompt.")] = 32,
    prompts: Annotated[
        Path | None, typer.Option(help="A file with one prompt per line (default: built-in set).")
    ] = None,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Also write the report as JSON here.")
    ] = None,
    devices: Devices = "cpu",
    max_length: MaxLength = 512,
    max_batch_size: MaxBatch = 8,
) -> int:
    """Logit parity of THETA against BASE; exit 1 when not native-equivalent."""
    from attnquant_core import require_intact
    from attnquant_max import AGREEMENT_THRESHOLD, DELTA_THRESHOLD, NEAR_TIE, logit_parity

    base, theta = _model(str(base)), _model(str(theta))
    for checkpoint in {base, theta}:  # MAX reads a dense base itself: check it here
        require_intact(checkpoint)
    texts = list(VERIFY_PROMPTS)
    if prompts is not None:
        texts = [line for line in prompts.read_text().splitlines() if line.strip()]
        if not texts:
            raise typer.BadParameter(f"{prompts}: no prompts in the file")
    report = logit_parity(
        base,
        theta,
        texts,
        max_new_tokens,
        max_length=max_length,
        max_batch_size=max_batch_size,
        devices=devices,
    )
    verdict = "native-equivalent" if report.native_equivalent else "NOT native-equivalent"
    table = Table(title=f"verify {theta} against {base}")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_column("bound", justify="right")
    table.add_row(
        "max |logprob delta|", f"{report.max_abs_logprob_delta:.3g}", f"< {DELTA_THRESHOLD}"
    )
    table.add_row("greedy agreement", f"{report.agreement:.1%}", f">= {AGREEMENT_THRESHOLD:.0%}")
    if report.miss_margins:
        # How close the base's own choice was where the theta model chose otherwise.
        table.add_row(
            "base top-2 margin at the misses",
            f"{report.miss_margins[0]:.3g} to {report.miss_margins[-1]:.3g} nats",
            f"{sum(m < NEAR_TIE for m in report.miss_margins)} of "
            f"{len(report.miss_margins)} < {NEAR_TIE}",
        )
    if report.near_ties is not None:
        table.add_row(
            f"base near-ties (margin < {NEAR_TIE})",
            f"{report.near_ties} of {report.num_tokens}",
            "",
        )
    table.add_row(
        "prompts x tokens",
        f"{report.num_prompts} x {report.num_tokens // max(report.num_prompts, 1)}",
        "",
    )
    if report.base_weight_bytes and report.theta_weight_bytes:
        table.add_row(
            "weights held (theta / base)",
            f"{report.theta_weight_bytes / 2**20:.2f} / {report.base_weight_bytes / 2**20:.2f} MiB",
            f"{report.theta_weight_bytes / report.base_weight_bytes:.3f}x",
        )
    out.print_table(table)
    out.print(f"verdict: {verdict}")
    if output is not None:
        import dataclasses
        import json

        from ._analyze import write_atomic

        payload = {"base": str(base), "theta": str(theta), **dataclasses.asdict(report)}
        write_atomic(output, lambda p: p.write_text(json.dumps(payload, indent=2) + "\n"))
    return 0 if report.native_equivalent else 1


@app.command()
def bench(
    base: Annotated[Path, typer.Argument(help="The stock (dense) checkpoint, or 'demo'.")],
    theta: Annotated[
        Path,
        typer.Argument(help="The checkpoint to compare, theta or dense; BASE again for A/A."),
    ],
    gate: Annotated[
        float,
        typer.Option(min=0.0, help="Pass when decode tok/s THETA/BASE is at least this."),
    ] = 0.8,
    repetitions: Annotated[
        int,
        typer.Option(min=6, help="Timed pairs (one run of each model, side by side); at least 6."),
    ] = 10,
    warmup: Annotated[
        int, typer.Option(min=0, help="Runs of each model made first and discarded.")
    ] = 1,
    order: Annotated[
        str,
        typer.Option(help="Order within pairs: abba (AB, BA, AB, ...) or random (seeded)."),
    ] = "abba",
    seed: Annotated[int, typer.Option(help="Seed of the random order and the bootstrap.")] = 0,
    prompt_tokens: Annotated[int, typer.Option(min=1, help="Prompt length (prefill).")] = 128,
    new_tokens: Annotated[int, typer.Option(min=2, help="Tokens generated (decode).")] = 64,
    output: Annotated[Path, typer.Option("--output", "-o", help="JSON results.")] = Path(
        "attnquant-bench.json"
    ),
    devices: Devices = "cpu",
    max_length: MaxLength = 512,
    max_batch_size: MaxBatch = 8,
) -> int:
    """Tokens per second of BASE and THETA, timed in adjacent pairs, THETA/BASE with its 95% CI.

    The ratio is taken within each pair (ABBA order) and its interval bootstrapped over the
    pairs, so load that drifts during the run cancels; the machine's load (load average, CPU
    time stolen) is printed and stored beside the result.

    A/A check: give the same model twice (attnquant bench BASE BASE) to time it against itself;
    it reports the half-width a real difference must exceed on this machine now, and exits 0
    when the interval holds 1.0, 1 when it does not.

    Exit status: 0 pass (the whole interval at or above --gate), 1 fail (all of it below),
    3 inconclusive (the interval straddles the gate), 2 usage error or bad input.
    """
    if order not in ("abba", "random"):
        raise typer.BadParameter(f"--order {order!r}: use 'abba' or 'random'")
    import json

    from attnquant_core import machine_load, read_load, require_intact
    from attnquant_max import AttnquantConfig, load_pipeline, plan_serving

    from ._analyze import write_atomic
    from ._bench import (
        bench_pair,
        bench_table,
        exit_code,
        generate_runner,
        prompt_ids,
        summarize,
        verdict_line,
    )

    base, theta = _model(str(base)), _model(str(theta))
    for checkpoint in {base, theta}:  # every tensor against its digest, before MAX loads
        require_intact(checkpoint)
    aa = base.resolve() == theta.resolve()
    if aa:
        console.print("A/A check: BASE against itself (the gate is not applied)", highlight=False)
    else:
        console.print(
            f"gate: decode tok/s THETA/BASE >= {gate} (set before the run)", highlight=False
        )
    config = AttnquantConfig.from_env()
    if not aa:
        console.print(plan_serving(theta, config).describe(), highlight=False, soft_wrap=True)
    common = {"max_length": max_length, "max_batch_size": max_batch_size, "devices": devices}
    # The base is the stock model, served as it is on the stock path whatever the ATTNQUANT_*
    # variables say (as `verify` serves its base); in A/A mode both sides are.
    base_model = load_pipeline(base, config=AttnquantConfig(), **common)
    theta_config = AttnquantConfig() if aa else config
    theta_model = load_pipeline(theta, config=theta_config, **common)
    try:
        prompt = prompt_ids(base_model.encode, prompt_tokens)
        before = read_load()
        runs = bench_pair(
            generate_runner(base_model),
            generate_runner(theta_model),
            prompt,
            pairs=repetitions,
            new_tokens=new_tokens,
            warmup=warmup,
            order=order,  # type: ignore[arg-type]
            seed=seed,
        )
        load = machine_load(before)
    finally:
        base_model.close()
        theta_model.close()
    result = summarize(runs, gate=None if aa else gate, load=load, seed=seed)
    result.update(
        base=str(base),
        theta=str(theta),
        repetitions=repetitions,
        prompt_tokens=len(prompt),
        new_tokens=new_tokens,
        devices=devices,
    )
    title = (
        f"bench {theta} against {base} ({repetitions} pairs in {order.upper()} order, "
        f"{warmup} warm-up run(s) of each discarded)"
    )
    out.print_table(bench_table(result, title=title, load=load))
    out.print(verdict_line(result), highlight=False)
    write_atomic(output, lambda p: p.write_text(json.dumps(result, indent=2) + "\n"))
    console.print(f"wrote {output}", highlight=False)
    return exit_code(result)


def cli(args: Sequence[str] | None = None) -> int:
    """Run the command line and return its exit code (tests call this directly)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        result = app(args=list(args) if args is not None else None, standalone_mode=False)
    except typer.Exit as exc:
        return exc.exit_code
    except typer.Abort:
        console.print("aborted")
        return 130
    except typer.TyperException as exc:  # usage errors: typer prints them like click does
        exc.show()  # type: ignore[attr-defined]
        return int(getattr(exc, "exit_code", 2))
    except (
        AttnquantError,
        ValueError,
        NotImplementedError,
        FileExistsError,
        FileNotFoundError,
    ) as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        return 2
    return result if isinstance(result, int) else 0


def main() -> None:
    """Console-script entry point."""
    sys.exit(cli())
