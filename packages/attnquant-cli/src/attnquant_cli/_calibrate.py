"""``attnquant calibrate``: every projection's input statistics, for fitting by function.

Runs the checkpoint over calibration text, layer by layer in numpy (attnquant-core's
reference forward, Llama family), and writes ``sum_t x_t x_t^T`` of each projection's input
to one safetensors file in the public format of ``attnquant_core.calib``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated

import numpy as np
import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from attnquant_core.calib import (
    DEFAULT_SAMPLES,
    DEFAULT_SEQ_LEN,
    SENSITIVITY_SAMPLES,
    CalibrationError,
    ModelSource,
    measure_sensitivity,
    open_source,
    read_texts,
    sensitivity_path,
    stats_digest,
    token_stream,
    token_windows,
)
from attnquant_core.calib import calibrate as run_calibration

from ._console import Output
from ._demo import demo_model_path

__all__ = [
    "DATA_DIR",
    "calibrate",
    "calibration_windows",
    "data_windows",
    "default_data",
    "layer_progress",
]

console = Output(stderr=True)
out = Output()

#: The text samples shipped for the demo model (see data/README.md).
DATA_DIR = Path(__file__).with_name("data")
DEMO_DATA = {
    "calibration": DATA_DIR / "demo_calibration.jsonl",
    "heldout": DATA_DIR / "demo_heldout.jsonl",
}

DataOption = Annotated[
    list[Path] | None,
    typer.Option(
        "--data",
        help="Text file, directory of them, or JSON Lines file with a 'text' field; repeat "
        "for more. [default: the demo model's shipped sample; required for other models]",
    ),
]


def resolve_model(ckpt: str) -> tuple[Path, bool]:
    """``(directory, is_demo)`` for a CKPT argument ('demo' names the embedded model)."""
    demo = demo_model_path()
    path = demo if ckpt == "demo" else Path(ckpt)
    return path, path.resolve() == demo.resolve()


def default_data(path: Path, is_demo: bool, data: list[Path] | None, kind: str) -> list[Path]:
    """``--data`` as given, else the demo's shipped sample of ``kind``, else a one-line error."""
    if data:
        return list(data)
    if is_demo:
        return [DEMO_DATA[kind]]
    raise CalibrationError(
        f"{path}: give the text to use with --data PATH (text files, directories of them or "
        f"JSON Lines with a 'text' field); only the demo model ships a default sample"
    )


def data_windows(
    path: Path,
    config: dict,
    data: list[Path],
    *,
    seq_len: int,
    samples: int | None,
    seed: int | None,
) -> tuple[np.ndarray, int]:
    """Token windows ``[n, T]`` of ``data`` tokenised by ``path``'s tokenizer, and the stream length."""
    stream = token_stream(path, read_texts(data), config)
    return token_windows(stream, seq_len=seq_len, samples=samples, seed=seed), len(stream)


def calibration_windows(
    source: ModelSource, texts: list[Path], *, samples: int, seq_len: int, seed: int
) -> np.ndarray:
    """The calibration windows ``[n, T]`` of ``texts`` for ``source`` (``--data``/``--samples``/
    ``--seq-len`` of ``calibrate``, ``--calibration-data`` of ``decompose``): ``seq_len``
    checked against the config, a note on stderr when the text holds fewer than asked."""
    path = source.path
    max_len = int(source.text_config.get("max_position_embeddings") or seq_len)
    if seq_len > max_len:
        raise CalibrationError(
            f"--seq-len {seq_len} exceeds {path}'s max_position_embeddings ({max_len})"
        )
    windows, stream_len = data_windows(
        path, source.config, texts, seq_len=seq_len, samples=samples, seed=seed
    )
    if windows.shape[0] < samples or windows.shape[1] < seq_len:
        console.print(
            f"note: the text holds {stream_len} tokens: {windows.shape[0]} sequence(s) of "
            f"{windows.shape[1]} tokens (asked for {samples} x {seq_len})",
            highlight=False,
        )
    return windows


def layer_progress() -> Progress:
    return Progress(
        TextColumn("{task.description:<26}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    )


def calibrate(
    ckpt: Annotated[str, typer.Argument(help="Hugging Face checkpoint directory (or 'demo').")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Statistics file to write.")],
    data: DataOption = None,
    samples: Annotated[
        int, typer.Option(min=1, help="Calibration sequences (capped by what the text holds).")
    ] = DEFAULT_SAMPLES,
    seq_len: Annotated[int, typer.Option(min=2, help="Tokens per sequence.")] = DEFAULT_SEQ_LEN,
    seed: Annotated[int, typer.Option(help="Seed of the choice of sequences.")] = 0,
    float64: Annotated[
        bool, typer.Option("--float64", help="Store the grams in float64 (default float32).")
    ] = False,
    batch: Annotated[int, typer.Option(min=1, help="Sequences per forward batch.")] = 8,
    sensitivity: Annotated[
        bool,
        typer.Option(
            "--sensitivity",
            help="Also measure what each projection's output error costs the model (KL per "
            "unit of squared output error, on the first --sensitivity-samples sequences; "
            "about 3.5 forwards per layer) into OUTPUT.sensitivity.json, for `decompose "
            "--budget --allocation sensitivity`.",
        ),
    ] = False,
    sensitivity_samples: Annotated[
        int,
        typer.Option(
            min=1,
            help="Sequences the --sensitivity probe runs on (the first of the calibration ones): "
            "its time grows with them (on SmolLM2-135M, 2 cores: about 6 min a sequence).",
        ),
    ] = SENSITIVITY_SAMPLES,
    json_output: Annotated[
        bool, typer.Option("--json", help="Print the figures as one JSON object on stdout.")
    ] = False,
) -> None:
    """Run CKPT over calibration text and write each projection's input gram sum x x^T.

    The forward is numpy, layer by layer (one layer's weights and the hidden states held);
    the file is the public statistics format that `decompose --calibration` reads.
    """
    path, is_demo = resolve_model(ckpt)
    texts = default_data(path, is_demo, data, "calibration")
    started = time.perf_counter()
    source = open_source(path)
    windows = calibration_windows(source, texts, samples=samples, seq_len=seq_len, seed=seed)
    with layer_progress() as progress:
        task = progress.add_task("calibrating layers", total=source.num_layers)
        report = run_calibration(
            source,
            windows,
            output,
            stats_dtype=np.float64 if float64 else np.float32,
            batch=batch,
            progress=lambda done, total: progress.update(task, completed=done),
        )
    sens_path = None
    if sensitivity:
        sens_path = sensitivity_path(output)
        with layer_progress() as progress:
            task = progress.add_task("measuring sensitivity", total=7 * source.num_layers)
            measure_sensitivity(
                source,
                windows,
                output,
                samples=sensitivity_samples,
                batch=batch,
                progress=lambda done, total: progress.update(task, completed=done, total=total),
            ).write(sens_path)
    wall = time.perf_counter() - started
    figures = {
        "output": str(output),
        "checkpoint": str(path),
        "data": [str(p) for p in texts],
        "tokens": report.tokens,
        "sequences": report.sequences,
        "seq_len": report.seq_len,
        "grams": report.grams,
        "digest": stats_digest(output),
        "wall_s": round(wall, 2),
        "peak_rss_bytes": report.peak_rss_bytes,
        "forward": "numpy",
        **({} if sens_path is None else {"sensitivity": str(sens_path)}),
    }
    console.print(
        f"wrote {output}: {report.grams} grams from {report.tokens} tokens "
        f"({report.sequences} x {report.seq_len}) in {wall:.1f} s, peak RSS "
        f"{report.peak_rss_bytes / 2**20:.0f} MiB (numpy forward)"
        + ("" if sens_path is None else f"; sensitivities in {sens_path}"),
        highlight=False,
        soft_wrap=True,
    )
    if json_output:
        sys.stdout.write(json.dumps(figures) + "\n")
