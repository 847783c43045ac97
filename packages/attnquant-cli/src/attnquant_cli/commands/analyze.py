"""``attnquant analyze``: error against compression over G x r, and the budget frontier."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from attnquant_core.fit import parse_budget

from ._shared import checkpoint_path, console, out

__all__ = ["analyze"]


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

    from .._analyze import (
        frontier_table,
        sweep_table,
        write_atomic,
        write_csv,
        write_json,
        write_plot,
    )

    src = checkpoint_path(ckpt)
    Gs, ranks = _int_list(blocks, "blocks"), _int_list(rank, "rank")
    budgets = [parse_budget(b.strip()) for b in budget.split(",")] if budget is not None else []
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
