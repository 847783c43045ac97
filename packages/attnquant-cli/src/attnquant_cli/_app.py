"""The ``attnquant`` command: composes attnquant-core (numpy) and attnquant-max (MAX).

Each command lives in its own module (:mod:`attnquant_cli.commands`, and ``_check``,
``_calibrate`` and ``_eval``); this module makes the typer ``app``, registers them and turns
errors into exit codes. MAX is imported lazily, inside the commands that need it, so
``attnquant --help`` and the numpy-only commands start instantly, and run without
attnquant-max installed: it is the ``serve`` extra (:mod:`attnquant_cli._extra`).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

import typer
from rich.markup import escape

from attnquant_core import AttnquantError

from ._calibrate import calibrate
from ._check import check
from ._eval import evaluate_command
from .commands._shared import console
from .commands.analyze import analyze
from .commands.bench import bench
from .commands.decompose import decompose
from .commands.export import export
from .commands.generate import generate
from .commands.import_gguf import import_command
from .commands.serve import serve
from .commands.verify import verify

__all__ = ["app", "cli", "main"]

app = typer.Typer(
    name="attnquant",
    help="Compress decoder LLM projections into theta bundles and serve them through MAX.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
# Registered in the order `attnquant --help` lists them.
app.command()(check)  # attnquant check CKPT: tensor digests
app.command(name="import")(import_command)  # attnquant import FILE.gguf -o DIR
app.command()(calibrate)  # attnquant calibrate CKPT -o STATS: input grams
app.command(name="eval")(evaluate_command)  # attnquant eval BASE [THETA...]
app.command()(decompose)  # attnquant decompose CKPT -o OUT: a theta checkpoint
app.command()(export)  # attnquant export CKPT -o OUT --format nvfp4
app.command()(analyze)  # attnquant analyze CKPT: error against compression
app.command()(serve)  # attnquant serve [MODEL]: OpenAI-compatible server through MAX
app.command()(generate)  # attnquant generate [MODEL] --prompt TEXT
app.command()(verify)  # attnquant verify BASE THETA: logit parity
app.command()(bench)  # attnquant bench BASE THETA: tok/s in ABBA pairs


@app.callback()
def _root() -> None:
    """Compress decoder LLM projections into theta bundles and serve them through MAX."""


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
        given = list(args) if args is not None else sys.argv[1:]
        if "unexpected extra argument" in str(exc) and any(a.endswith("data") for a in given):
            console.print("hint: give each path its own option: --data A --data B", soft_wrap=True)
        return int(getattr(exc, "exit_code", 2))
    except (
        AttnquantError,
        ValueError,
        NotImplementedError,
        FileExistsError,
        FileNotFoundError,
    ) as exc:
        # escaped: a message may hold brackets (`[serve]`) that rich would read as markup
        console.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return 2
    return result if isinstance(result, int) else 0


def main() -> None:
    """Console-script entry point."""
    sys.exit(cli())
