"""``attnquant eval``: judge checkpoints by function on held-out text.

Perplexity, top-1 agreement with BASE and mean KL(BASE || checkpoint) per token, through one
of two forwards (``--forward``):

* ``max``: MAX itself, built with ``enable_echo`` so that its graph returns the logits of
  every prompt position, with prefix caching and chunked prefill off
  (:func:`attnquant_max.evaluate_max`); the full distributions are read, so all three figures
  come from MAX;
* ``numpy``: attnquant-core's layer-by-layer numpy forward (theta checkpoints rebuilt dense),
  float32 or ``--float64``; it also runs architectures MAX does not run on this device.

``auto`` (the default) takes MAX where every checkpoint's architecture runs there on
``--devices`` and numpy otherwise (and for ``--float64``); the table title and the JSON say which
forward produced the figures, and why.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
import typer
from rich.table import Table

from attnquant_core.calib import DEFAULT_SEQ_LEN, EvalResult, evaluate, open_source
from attnquant_core.serving import ServingOptions

from ._calibrate import DataOption, data_windows, default_data, layer_progress, resolve_model
from ._console import Output
from ._extra import SERVE_EXTRA, ServeExtraError, require_max
from .commands._serving import serving_flags

__all__ = ["choose_forward", "eval_table", "evaluate_command"]

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


Forward = Literal["auto", "max", "numpy"]


def choose_forward(
    forward: str, paths: list[Path], *, devices: str, float64: bool
) -> tuple[str, str]:
    """``("max" | "numpy", why)`` for ``--forward`` over these checkpoints; a ``max`` that
    cannot be done is a one-line ``ValueError`` (docs/architecture.md)."""
    if forward not in ("auto", "max", "numpy"):
        raise typer.BadParameter(f"--forward {forward!r}: choose auto, max or numpy")
    if forward == "numpy":
        return "numpy", "--forward numpy"
    if float64:
        if forward == "max":
            raise ValueError("--forward max with --float64: MAX computes in float32; use numpy")
        return "numpy", "--float64: MAX computes in float32"
    try:
        require_max("eval --forward max")
        from attnquant_max import max_unavailable
    except ServeExtraError:  # the serve extra is not installed
        if forward == "max":
            raise
        reasons = [f"attnquant-max is not installed ({SERVE_EXTRA})"]
    except ImportError as exc:  # attnquant-max installed but broken
        reasons = [f"attnquant-max cannot be imported ({exc})"]
    else:
        reasons = [r for r in (max_unavailable(p, devices) for p in paths) if r is not None]
    if not reasons:
        return "max", f"--forward {forward}: every checkpoint runs in MAX on {devices}"
    if forward == "max":
        raise ValueError(f"--forward max: {reasons[0]}")
    return "numpy", f"auto: {reasons[0]}"


def reference_note(base: Path) -> str | None:
    """What the reference is when BASE was imported from a quantized GGUF: the dequantized
    model, not the one the GGUF was made from (``None`` otherwise)."""
    from attnquant_core.io import gguf_source

    record = gguf_source(base)
    if not record or not record.get("quantized"):
        return None
    return (
        f"reference: {base.name}, dequantized from {record['source']} "
        f"({len(record['quantized'])} tensors were quantized there)"
    )


@serving_flags
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
    batch: Annotated[
        int, typer.Option(min=1, help="Windows per forward batch (numpy forward).")
    ] = 8,
    forward: Annotated[
        str,
        typer.Option(
            help="auto (MAX where every checkpoint runs there on --devices, else numpy), max "
            "(all-position logits of an echo-built MAX model) or numpy (attnquant-core's "
            "reference forward)."
        ),
    ] = "auto",
    devices: Annotated[
        str, typer.Option(help="MAX devices for --forward max/auto: cpu, gpu, gpu:0.")
    ] = "cpu",
    json_output: Annotated[
        bool,
        typer.Option(
            "--json", help="Print the figures as one JSON object on stdout (table to stderr)."
        ),
    ] = False,
    decode_steps: Annotated[
        bool,
        typer.Option(
            "--decode-steps",
            help="Through MAX, score each window as serving computes it: its first token "
            "prefilled, every next one fed back as a single-row decode step (judges what runs "
            "only in decode steps, e.g. --nvfp4-int8; one forward per token, slower).",
        ),
    ] = False,
    options: ServingOptions = ServingOptions(),
) -> None:
    """Perplexity, top-1 agreement with BASE and KL(BASE || it) for BASE and each checkpoint.

    Held-out text: --data, or for the demo model a shipped sample it was not trained on.
    Every window of --seq-len tokens predicts its next tokens, through MAX or attnquant-core's
    numpy forward (--forward; the output says which). With checkpoints after it, BASE is
    served without quantization at load (--quant, --quant-head and --quant-embedding apply to
    the others), so `eval demo demo --quant nvfp4` judges load-time quantization.
    """
    base_path, is_demo = resolve_model(base)
    paths = [base_path] + [resolve_model(c)[0] for c in checkpoints or []]
    names = [base, *(checkpoints or [])]
    texts = default_data(base_path, is_demo, data, "heldout")
    chosen, why = choose_forward(forward, paths, devices=devices, float64=float64)
    if decode_steps and chosen != "max":
        raise typer.BadParameter(
            f"--decode-steps needs the MAX forward (the numpy forward has no decode steps); "
            f"here: {why}"
        )
    if forward == "auto" and chosen == "numpy":  # say why MAX was not used (no markup: [serve])
        console.print(f"eval: numpy forward, {why}", highlight=False, markup=False, soft_wrap=True)
    started = time.perf_counter()
    sources = [open_source(p) for p in paths]
    max_len = int(sources[0].config.get("max_position_embeddings") or seq_len)
    seq_len = min(seq_len, max_len)
    windows, stream_len = data_windows(
        base_path, sources[0].config, texts, seq_len=seq_len, samples=samples, seed=None
    )
    dtype = np.float64 if float64 else np.float32
    with layer_progress() as progress:
        if chosen == "max":
            from attnquant_max import evaluate_max

            tasks = {
                str(p): progress.add_task(f"MAX {p.name[-22:]}", total=len(windows)) for p in paths
            }
            results = evaluate_max(
                paths,
                windows,
                devices=devices,
                options=options,
                progress=lambda name, done, total: progress.update(tasks[name], completed=done),
                decode_steps=decode_steps,
            )
        else:
            tasks = {
                str(s.path): progress.add_task(s.path.name[-26:], total=s.num_layers)
                for s in sources
            }
            results = evaluate(
                sources,
                windows,
                dtype=dtype,
                batch=batch,
                progress=lambda name, done, total: progress.update(tasks[name], completed=done),
            )
    wall = time.perf_counter() - started
    engine = (
        f"MAX on {devices} ("
        + ("decode steps, teacher-forced" if decode_steps else "echo model, full logits")
        + ")"
        if chosen == "max"
        else f"numpy forward ({np.dtype(dtype).name})"
    )
    how = (
        f"{engine}, {windows.shape[0]} window(s) x "
        f"{windows.shape[1]} tokens of {stream_len} held-out tokens, "
        f"{results[0].tokens} predictions; {wall:.1f} s"
    )
    reference = reference_note(base_path)
    if reference:
        how += f"; {reference}"
    (console if json_output else out).print_table(
        eval_table(results, title=f"eval: {how}", names=names)
    )
    if json_output:
        payload = {
            "reference": reference,
            "forward": chosen,
            "forward_why": why,
            "devices": devices if chosen == "max" else None,
            "decode_steps": decode_steps,
            "dtype": (
                np.dtype(dtype).name
                if chosen == "numpy"
                else "float32"
                if devices.strip().lower().startswith("cpu")
                else "MAX's default encoding for the checkpoint"
            ),
            "data": [str(p) for p in texts],
            "windows": int(windows.shape[0]),
            "seq_len": int(windows.shape[1]),
            "tokens": results[0].tokens,
            "wall_s": round(wall, 2),
            "results": [
                {
                    **r.as_dict,
                    "forward": {k: chosen for k in ("perplexity", "top1_agreement", "kl")},
                    "name": name,
                    "perplexity_ratio": r.perplexity / results[0].perplexity,
                }
                for name, r in zip(names, results, strict=True)
            ],
        }
        sys.stdout.write(json.dumps(payload) + "\n")
