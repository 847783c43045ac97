"""``attnquant eval``: judge checkpoints by function on held-out text.

Perplexity, top-1 agreement with BASE and mean KL(BASE || checkpoint) per token, through
attnquant-core's numpy forward (layer by layer; a theta checkpoint's projections are rebuilt
dense through core's public API). MAX is not used: its prompt log-probabilities are not
compared here, so every figure comes from one exact reference forward.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Annotated

import numpy as np
import typer
from rich.table import Table

from attnquant_core.calib import DEFAULT_SEQ_LEN, EvalResult, evaluate, open_source

from ._calibrate import DataOption, data_windows, default_data, layer_progress, resolve_model
from ._console import Output

__all__ = ["eval_table", "evaluate_command"]

console = Output(stderr=True)
out = Output()


def eval_table(results: list[EvalResult], *, title: str, names: list[str] | None = None) -> Table:
    table = Table(title=title)
    for col in ("checkpoint", "perplexity", "ppl / base", "top-1 agreement", "KL (nats/token)"):
        table.add_column(col, justify="left" if col == "checkpoint" else "right")
    base = results[0].perplexity
    for i, r in enumerate(results):
        table.add_row(
            (names[i] if names else r.checkpoint) + (" (base)" if i == 0 else ""),
            f"{r.perplexity:.3f}",
            f"{r.perplexity / base:.4f}",
            f"{100 * r.top1:.2f}%",
            f"{r.kl:.5f}",
        )
    return table


def evaluate_command(
    base: Annotated[str, typer.Argument(help="The reference checkpoint (or 'demo').")],
    checkpoints: Annotated[
        list[str] | None,
        typer.Argument(help="Checkpoints to judge against BASE (theta or dense)."),
    ] = None,
    data: DataOption = None,
    seq_len: Annotated[int, typer.Option(min=2, help="Tokens per window.")] = DEFAULT_SEQ_LEN,
    samples: Annotated[
        int | None, typer.Option(min=1, help="Windows evaluated. [default: every whole one]")
    ] = None,
    float64: Annotated[
        bool, typer.Option("--float64", help="Run the forward in float64 (default float32).")
    ] = False,
    batch: Annotated[int, typer.Option(min=1, help="Windows per forward batch.")] = 8,
    json_output: Annotated[
        bool,
        typer.Option(
            "--json", help="Print the figures as one JSON object on stdout (table to stderr)."
        ),
    ] = False,
) -> None:
    """Perplexity, top-1 agreement with BASE and KL(BASE || it) for BASE and each checkpoint.

    Held-out text: --data, or for the demo model a shipped sample it was not trained on.
    Every window of --seq-len tokens predicts its next tokens; the forward is attnquant-core's
    numpy reference (theta checkpoints rebuilt dense), not MAX.
    """
    base_path, is_demo = resolve_model(base)
    paths = [base_path] + [resolve_model(c)[0] for c in checkpoints or []]
    names = [base, *(checkpoints or [])]
    texts = default_data(base_path, is_demo, data, "heldout")
    started = time.perf_counter()
    sources = [open_source(p) for p in paths]
    max_len = int(sources[0].config.get("max_position_embeddings") or seq_len)
    seq_len = min(seq_len, max_len)
    windows, stream_len = data_windows(
        base_path, sources[0].config, texts, seq_len=seq_len, samples=samples, seed=None
    )
    dtype = np.float64 if float64 else np.float32
    with layer_progress() as progress:
        tasks = {
            str(s.path): progress.add_task(s.path.name[-26:], total=s.num_layers) for s in sources
        }
        results = evaluate(
            sources,
            windows,
            dtype=dtype,
            batch=batch,
            progress=lambda name, done, total: progress.update(tasks[name], completed=done),
        )
    wall = time.perf_counter() - started
    how = (
        f"numpy forward ({np.dtype(dtype).name}), {windows.shape[0]} window(s) x "
        f"{windows.shape[1]} tokens of {stream_len} held-out tokens, "
        f"{results[0].tokens} predictions; {wall:.1f} s"
    )
    (console if json_output else out).print_table(
        eval_table(results, title=f"eval: {how}", names=names)
    )
    if json_output:
        payload = {
            "forward": "numpy",
            "dtype": np.dtype(dtype).name,
            "data": [str(p) for p in texts],
            "windows": int(windows.shape[0]),
            "seq_len": int(windows.shape[1]),
            "tokens": results[0].tokens,
            "wall_s": round(wall, 2),
            "results": [
                {
                    **r.as_dict,
                    "name": name,
                    "perplexity_ratio": r.perplexity / results[0].perplexity,
                }
                for name, r in zip(names, results, strict=True)
            ],
        }
        sys.stdout.write(json.dumps(payload) + "\n")
