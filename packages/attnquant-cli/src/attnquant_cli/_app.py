"""The ``attnquant`` command: composes attnquant-core (numpy) and attnquant-max (MAX).

MAX is imported lazily, inside the commands that need it, so ``attnquant --help`` and the
numpy-only commands start instantly.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from attnquant_core import AttnquantError, DecomposeProgress, decompose_checkpoint

from ._demo import demo_model_path

__all__ = ["app", "cli", "main"]

app = typer.Typer(
    name="attnquant",
    help="Compress decoder LLM projections into theta bundles and serve them through MAX.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console(stderr=True)
out = Console()


@app.callback()
def _root() -> None:
    """Compress decoder LLM projections into theta bundles and serve them through MAX."""


@app.command()
def decompose(
    ckpt: Annotated[Path, typer.Argument(help="Hugging Face checkpoint directory (or 'demo').")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Theta checkpoint to write.")],
    blocks: Annotated[
        str, typer.Option(help="Shared blocks G per family, or 'layers' (passthrough).")
    ] = "1",
    rank: Annotated[int, typer.Option(min=0, help="Rank r of the per-layer correction.")] = 16,
    overwrite: Annotated[bool, typer.Option(help="Replace OUTPUT if it exists.")] = False,
) -> None:
    """Decompose every projection family of CKPT into a theta checkpoint."""
    src = demo_model_path() if str(ckpt) == "demo" else ckpt
    with Progress(
        TextColumn("{task.description:<18}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("err {task.fields[error]:.4f}"),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        tasks: dict[str, int] = {}

        def report(event: DecomposeProgress) -> None:
            if event.family not in tasks:
                tasks[event.family] = progress.add_task(
                    event.family, total=event.num_layers, error=0.0
                )
            progress.update(tasks[event.family], advance=1, error=event.error)

        manifest = decompose_checkpoint(
            src, output, blocks=blocks, rank=rank, progress=report, overwrite=overwrite
        )
    table = Table(title=f"{output}  (G={manifest['blocks']}, r={manifest['rank']})")
    for col in ("family", "shape", "bands", "rank", "rel. error", "stored / dense"):
        table.add_column(col, justify="left" if col == "family" else "right")
    total_stored = total_dense = 0
    for name, fam in manifest["families"].items():
        out_dim, in_dim = fam["shape"]
        L, G, r = len(fam["bands"]), max(fam["bands"]) + 1, fam["rank"]
        stored = G * out_dim * in_dim + L * (out_dim + r * (out_dim + in_dim))
        dense = L * out_dim * in_dim
        total_stored += stored
        total_dense += dense
        table.add_row(
            name,
            f"{out_dim}x{in_dim}",
            str(G),
            str(r),
            f"{fam['error']:.4f}",
            f"{stored / dense:.3f}",
        )
    table.add_row("total", "", "", "", "", f"{total_stored / total_dense:.3f}", style="bold")
    out.print(table)


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
    except (AttnquantError, FileExistsError, FileNotFoundError) as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        return 2
    return result if isinstance(result, int) else 0


def main() -> None:
    """Console-script entry point."""
    sys.exit(cli())
