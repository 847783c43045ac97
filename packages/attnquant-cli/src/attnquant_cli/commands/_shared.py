"""What the commands share: consoles, progress bars, JSON output, the demo model, options."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from attnquant_core import DecomposeProgress

from .._console import Output
from .._demo import demo_model_path

__all__ = [
    "Devices",
    "JsonFlag",
    "MaxBatch",
    "MaxLength",
    "ModelArg",
    "console",
    "checkpoint_path",
    "model_path",
    "out",
    "print_json",
    "progress_bars",
    "reporter",
]

#: Messages, progress and (with ``--json``) tables go to stderr; results to stdout.
console = Output(stderr=True)
out = Output()

JsonFlag = Annotated[
    bool,
    typer.Option(
        "--json", help="Print the figures as one JSON object on stdout (tables go to stderr)."
    ),
]

# The options every serving command (serve, generate, verify, bench) takes.
ModelArg = Annotated[
    str | None,
    typer.Argument(
        help="Checkpoint directory, theta or dense; the embedded demo model if omitted."
    ),
]
MaxLength = Annotated[int, typer.Option(min=8, help="Longest prompt plus completion, in tokens.")]
MaxBatch = Annotated[int, typer.Option(min=1, help="Requests batched per forward pass.")]
Devices = Annotated[str, typer.Option(help="MAX devices: cpu, gpu, gpu:0,1.")]


def checkpoint_path(ckpt: str | Path) -> Path:
    """A CKPT argument as a directory: 'demo' names the embedded demo model."""
    return demo_model_path() if str(ckpt) == "demo" else Path(ckpt)


def model_path(model: str | None) -> Path:
    """The checkpoint a serving command acts on: the demo model when none (or 'demo') is given."""
    return demo_model_path() if model in (None, "demo") else Path(model)


def print_json(payload: object) -> None:
    """``--json``: ``payload`` as one line of JSON on stdout."""
    import json

    sys.stdout.write(json.dumps(payload) + "\n")


def progress_bars() -> Progress:
    """Progress bars on stderr, one per family and stage, with the running error."""
    return Progress(
        TextColumn("{task.description:<26}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("err {task.fields[error]:.4f}"),
        TimeElapsedColumn(),
        console=console,
    )


def reporter(progress: Progress) -> Callable[[DecomposeProgress], None]:
    """A core ``progress=`` callback that advances ``progress``'s bar of each family and stage."""
    tasks: dict[tuple[str, str], TaskID] = {}

    def report(event: DecomposeProgress) -> None:
        key = (event.family, event.stage)
        if key not in tasks:
            what = event.family if event.stage == "fit" else f"{event.family} ({event.stage})"
            tasks[key] = progress.add_task(what, total=event.num_layers, error=0.0)
        error = event.error if event.error == event.error else 0.0  # NaN while measuring
        progress.update(tasks[key], advance=1, error=error)

    return report
