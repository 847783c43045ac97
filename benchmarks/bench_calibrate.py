"""Calibration and calibrated decomposition memory: a synthetic Llama-3.2-1B, phase by phase.

Writes the synthetic float32 checkpoint of ``--shape`` (``synthetic_llama.write_synthetic``:
``1b`` is Llama-3.2-1B's shapes, 16 layers, hidden 2048, MLP 8192, tied 128256 x 2048
embedding, random weights with a decaying spectrum and the demo model's tokenizer; ``tiny`` for a
smoke run), then runs the command line, each phase in its own fresh worker process so that each
peak RSS is its own (``VmHWM`` of the worker, which exec resets):

1. ``attnquant calibrate CKPT --data DATA --samples N --seq-len T -o STATS`` (the numpy
   forward, layer by layer; grams float32 on disk, accumulated in float64);
2. ``attnquant decompose CKPT -o THETA --budget B --calibration STATS``;
   (``--blocks G --rank R``: ``decompose CKPT -o THETA --blocks G --rank R --calibration STATS``
   instead, a fixed-form whitened decomposition, far fewer factorisations of each whitened
   matrix than a budget's every candidate form; ``--layers N``: decompose the first ``N``
   layers only, a checkpoint of the same model cut to ``N`` layers, written the same way, with
   the statistics of the whole model: a layer's inputs depend only on the layers below it, so
   those of the first ``N`` layers are exactly the cut model's, and every layer is fit alike,
   one at a time, so the peak is that of any ``N``);
3. with ``--sequential`` only: ``attnquant decompose CKPT -o THETA2 --budget B
   --calibration-data DATA --samples N --seq-len T --sequential`` (a dense and a compressed
   stream side by side; about twice phase 1's forward plus phase 2's fit).

``DATA`` defaults to the demo model's shipped calibration sample (``demo_calibration.jsonl``,
~13.8k tokens of the demo tokenizer). Each phase reports its wall time, peak RSS (and when in
the run it peaked, from a 0.25 s ``VmRSS`` sampler), beside an RSS budget derived from the design goal
("peak memory follows the largest single weight", plus what calibration must hold):

* decomposition: ``300 MiB + 4 x largest weight`` as ``bench_decompose.py`` states it. Two
  readings are reported, both fixed before any run: ``largest tensor`` (the design goal's "largest single
  weight": any tensor the run reads, here the embedding, 1002 MiB at 1b) and the stricter
  ``largest projection`` (what ``bench_decompose.py``'s checkpoint, projections only, measures;
  64 MiB at 1b, gate/up/down);
* one layer's statistics: the float64 grams of one layer's distinct projection inputs,
  ``8 x (hidden^2 [q/k/v] + q_out^2 [o_proj] + hidden^2 [gate/up] + intermediate^2
  [down_proj])`` bytes (608 MiB at 1b);
* for calibration, the hidden states: ``tokens x hidden x 4 bytes x 4`` (the stream and up
  to three stream-sized temporaries); the sequential phase counts two streams (``x 8``).

Phase budgets: calibrate = decomposition + statistics + hidden states; decompose =
decomposition + statistics; sequential = decomposition + statistics + two streams. Peak RSS
should not grow with the layer count; with tokens it grows only through the hidden-state term
(``tokens x hidden x 16`` bytes: 32 KiB a token at hidden 2048) and, up to ``--batch x seq_len``
tokens, the per-batch activations (the forward runs ``--batch`` sequences at a time); the
grams and weights do not depend on the token count.

``VmHWM`` counts the file-backed pages of a memory-mapped read while they are mapped: core reads
a tensor by copying it out of a mapping, so reading one costs up to twice its size for a moment
(the 1b embedding: ~2 GiB). The grams are float64 in memory, float32 on disk.

The machine these figures come from is shared: every worker runs at niceness 15 with one
BLAS thread (``OMP_NUM_THREADS=OPENBLAS_NUM_THREADS=MKL_NUM_THREADS=1``), which affects the wall
times, not the memory. Everything (at 1b: the checkpoint, 4.6 GiB; the statistics, 5.5 GiB, one
float32 gram per projection key; the theta checkpoints) goes under ``--workdir`` (default
``/tmp``) and is deleted at the end; ``--checkpoint DIR`` keeps (and reuses) the checkpoint,
``--stats FILE`` the statistics (and the calibrate phase's figures, in ``FILE.calibrate.json``:
a rerun reports the phase that made them, marked ``reused``).

Run: ``HF_HUB_OFFLINE=1 uv run --all-packages --group bench python benchmarks/bench_calibrate.py
--shape 1b --out r.json`` (or ``uv run nox -s bench -- bench_calibrate --shape tiny``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from importlib.resources import files
from pathlib import Path

from synthetic_llama import SHAPES, ModelShape, projection_shapes, write_synthetic

MiB = 2**20
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
NICE = 15
HIDDEN_COPIES = 4  # the hidden-state stream and up to three temporaries of its size


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


class RssSampler:
    """``VmRSS`` every ``period`` seconds in a thread: when the peak came, and a coarse trace."""

    def __init__(self, period: float = 0.25) -> None:
        self.period = period
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter() - self._t0, _status_kib("VmRSS") / 1024))
            self._stop.wait(self.period)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self, points: int = 40) -> dict:
        if not self.samples:
            return {}
        t_peak, rss_peak = max(self.samples, key=lambda s: s[1])
        step = max(1, len(self.samples) // points)
        return {
            "sampled_peak_mb": rss_peak,
            "sampled_peak_at_s": t_peak,
            "trace": [[round(t, 1), round(r)] for t, r in self.samples[::step]],
        }


def worker_cli(args: list[str], result: Path) -> None:
    """Run ``attnquant ARGS`` in this process; write wall, peak RSS and its JSON to ``result``."""
    from attnquant_cli import cli

    captured = io.StringIO()
    t0 = time.perf_counter()
    with RssSampler() as sampler, contextlib.redirect_stdout(captured):
        rc = cli(args)
    wall = time.perf_counter() - t0
    lines = [line for line in captured.getvalue().splitlines() if line.startswith("{")]
    result.write_text(
        json.dumps(
            {
                "command": ["attnquant", *args],
                "rc": rc,
                "wall_s": wall,
                "peak_rss_mb": _status_kib("VmHWM") / 1024,
                **sampler.summary(),
                "cli": json.loads(lines[-1]) if lines else None,
            }
        )
    )


def worker_write(shape: str, directory: Path, result: Path, layers: int | None = None) -> None:
    from attnquant_cli import demo_model_path

    t0 = time.perf_counter()
    model = SHAPES[shape] if layers is None else replace(SHAPES[shape], layers=layers)
    write_synthetic(directory, model, demo_model_path())
    result.write_text(
        json.dumps({"wall_s": time.perf_counter() - t0, "peak_rss_mb": _status_kib("VmHWM") / 1024})
    )


def _spawn(work: Path, name: str, *args: str) -> dict:
    """This script as a worker (niceness 15, one BLAS thread); its result file's JSON."""
    result = work / f"{name}.result.json"
    env = {**os.environ, **ONE_THREAD, "HF_HUB_OFFLINE": "1"}
    # Niceness 15 whatever the caller's (``nice -n 15`` of an already niced run would give 19).
    command = [sys.executable, __file__, "--result", str(result), *args]
    if (increment := NICE - os.nice(0)) > 0:
        command = ["nice", "-n", str(increment), *command]
    print(f"[{name}] {' '.join(command)}", flush=True)
    done = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0 or not result.exists():
        raise SystemExit(f"[{name}] worker failed with exit code {done.returncode}")
    return json.loads(result.read_text())


def budgets(shape: ModelShape, tokens: int) -> dict:
    """The RSS budgets (MiB) of each phase, from the shape alone (see the module docstring)."""
    proj = projection_shapes(shape)
    largest_projection = max(o * i for o, i in proj.values()) * 4
    largest_tensor = max(largest_projection, shape.vocab * shape.hidden * 4)
    q_out = proj["self_attn.o_proj"][1]
    grams = 8 * (2 * shape.hidden**2 + q_out**2 + shape.intermediate**2)
    hidden = tokens * shape.hidden * 4 * HIDDEN_COPIES
    out: dict = {
        "largest_tensor_mb": largest_tensor / MiB,
        "largest_projection_mb": largest_projection / MiB,
        "layer_statistics_mb": grams / MiB,
        "layer_statistics_terms": {
            "q/k/v (hidden^2)": shape.hidden**2,
            "o_proj (q_out^2)": q_out**2,
            "gate/up (hidden^2)": shape.hidden**2,
            "down_proj (intermediate^2)": shape.intermediate**2,
            "bytes_each": 8,
        },
        "hidden_states_mb": hidden / MiB,
        "hidden_states_formula": f"tokens x hidden x 4 bytes x {HIDDEN_COPIES}",
    }
    for reading, nbytes in (
        ("largest_tensor", largest_tensor),
        ("largest_projection", largest_projection),
    ):
        decomposition = 300 + 4 * nbytes / MiB
        out[reading] = {
            "decomposition_mb": decomposition,
            "calibrate_mb": decomposition + (grams + hidden) / MiB,
            "decompose_mb": decomposition + grams / MiB,
            "sequential_mb": decomposition + (grams + 2 * hidden) / MiB,
        }
    return out


def _manifest_figures(theta: Path) -> dict:
    """Reached size and errors from the theta checkpoint's ``attnquant.json``: the budget's
    stored/dense, its predicted error (of the output, with statistics: the whitened spectra),
    its measured weight error, and per family the form, weight error and, where the fit
    measured them (sequential), the mean and max relative output error of its layers."""
    manifest = json.loads((theta / "attnquant.json").read_text())
    budget = manifest.get("budget") or {}
    figures: dict = {
        k: budget[k]
        for k in ("stored_parameters", "dense_parameters", "stored_over_dense", "predicted_error")
        if k in budget
    }
    if "measured_error" in budget:
        figures["measured_weight_error"] = budget["measured_error"]
    families = {}
    for name, fam in manifest["families"].items():
        row = {"form": fam.get("form"), "ranks": fam.get("ranks"), "weight_error": fam["error"]}
        if fam.get("output_errors"):
            row["output_error_mean"] = sum(fam["output_errors"]) / len(fam["output_errors"])
            row["output_error_max"] = max(fam["output_errors"])
        families[name] = row
    figures["families"] = families
    figures["calibration"] = {
        k: v for k, v in (manifest.get("calibration") or {}).items() if k != "objective"
    }
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="1b")
    parser.add_argument("--samples", type=int, default=16, help="calibration sequences N")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per sequence T")
    parser.add_argument("--batch", type=int, default=8, help="calibrate's sequences per batch")
    parser.add_argument("--budget", default="0.5", help="decompose --budget")
    parser.add_argument(
        "--blocks", help="decompose --blocks G --rank R --calibration instead of --budget"
    )
    parser.add_argument("--rank", type=int, help="with --blocks: decompose --rank")
    parser.add_argument(
        "--layers",
        type=int,
        help="decompose the first N layers only (the model cut to N layers, the whole "
        "model's statistics)",
    )
    parser.add_argument(
        "--stats",
        type=Path,
        help="use (and keep) the statistics here, calibrated first if missing "
        "[default: written under --workdir and deleted]",
    )
    parser.add_argument("--data", type=Path, help="calibration text [default: the demo's sample]")
    parser.add_argument(
        "--sequential",
        action="store_true",
        help="also run decompose --calibration-data --sequential (about twice as long)",
    )
    parser.add_argument("--workdir", type=Path, default=Path("/tmp"))
    parser.add_argument(
        "--checkpoint",
        type=Path,
        help="use (and keep) the synthetic checkpoint here, written first if missing "
        "[default: written under --workdir and deleted]",
    )
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--worker", choices=["write", "cli"], help=argparse.SUPPRESS)
    parser.add_argument("--dst", type=Path, help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.worker == "write":
        worker_write(args.shape, args.dst, args.result, args.layers)
        return
    if args.worker == "cli":
        worker_cli([a for a in rest if a != "--"], args.result)
        return
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if (args.blocks is None) != (args.rank is None):
        parser.error("--blocks and --rank go together")

    data = args.data or Path(str(files("attnquant_cli") / "data" / "demo_calibration.jsonl"))
    shape = SHAPES[args.shape]
    proj_params, all_params = shape.parameters()
    work = Path(tempfile.mkdtemp(prefix=f"aq-bench-calibrate-{shape.name}-", dir=args.workdir))
    ckpt, stats = args.checkpoint or work / "ckpt", args.stats or work / "stats.safetensors"
    calibrated_json = stats.with_name(stats.name + ".calibrate.json")
    common = ["--data", str(data), "--samples", str(args.samples), "--seq-len", str(args.seq_len)]
    phases: dict[str, dict] = {}
    try:
        written = {"wall_s": None, "reused": True}
        config = ckpt / "config.json"
        if config.exists() and json.loads(config.read_text()) != shape.config():
            raise SystemExit(f"{ckpt}: not the synthetic {shape.name} checkpoint")
        if not (ckpt / "model.safetensors.index.json").exists():
            written = _spawn(
                work, "write", "--worker", "write", "--shape", shape.name, "--dst", str(ckpt)
            )
        ckpt_bytes = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
        when = "reused" if written.get("reused") else f"written in {written['wall_s']:.0f} s"
        print(f"{ckpt}: {ckpt_bytes / 2**30:.2f} GiB, {when}", flush=True)
        calib_args = ["calibrate", str(ckpt), *common, "--batch", str(args.batch)]
        if args.stats is not None and stats.exists() and calibrated_json.exists():
            phases["calibrate"] = {**json.loads(calibrated_json.read_text()), "reused": True}
            print(f"{stats}: reused, calibrated by {calibrated_json}", flush=True)
        else:
            phases["calibrate"] = _spawn(
                work, "calibrate", "--worker", "cli", "--", *calib_args, "-o", str(stats), "--json"
            )
            if args.stats is not None:
                calibrated_json.write_text(json.dumps(phases["calibrate"]))
        stats_bytes = stats.stat().st_size
        target = ckpt
        if args.layers is not None:
            target = work / f"ckpt-{args.layers}-layers"
            _spawn(
                work,
                "write-cut",
                "--worker",
                "write",
                "--shape",
                shape.name,
                "--layers",
                str(args.layers),
                "--dst",
                str(target),
            )
        form = (
            ["--budget", args.budget]
            if args.blocks is None
            else ["--blocks", args.blocks, "--rank", str(args.rank)]
        )
        phases["decompose"] = _spawn(
            work,
            "decompose",
            "--worker",
            "cli",
            "--",
            "decompose",
            str(target),
            "-o",
            str(work / "theta"),
            *form,
            "--calibration",
            str(stats),
            "--json",
        )
        phases["decompose"]["manifest"] = _manifest_figures(work / "theta")
        shutil.rmtree(work / "theta", ignore_errors=True)
        if args.sequential:
            phases["sequential"] = _spawn(
                work,
                "sequential",
                "--worker",
                "cli",
                "--",
                "decompose",
                str(ckpt),
                "-o",
                str(work / "theta-seq"),
                "--budget",
                args.budget,
                "--calibration-data",
                *common[1:],
                "--sequential",
                "--json",
            )
            phases["sequential"]["manifest"] = _manifest_figures(work / "theta-seq")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    calibrated = phases["calibrate"].get("cli") or {}
    tokens = int(calibrated.get("tokens") or args.samples * args.seq_len)
    limits = budgets(shape, tokens)
    rows = {}
    for name, run in phases.items():
        row = {
            k: run.get(k) for k in ("rc", "wall_s", "peak_rss_mb", "sampled_peak_at_s", "command")
        }
        row["rss_budget_mb"] = {
            r: limits[r][f"{name}_mb"] for r in ("largest_tensor", "largest_projection")
        }
        row["within_rss_budget"] = {
            r: run["peak_rss_mb"] <= mb for r, mb in row["rss_budget_mb"].items()
        }
        row["trace"] = run.get("trace")
        if run.get("reused"):
            row["reused"] = True
        if "manifest" in run:
            row.update(run["manifest"])
        rows[name] = row
    result = {
        "benchmark": "calibrate",
        "shape": shape.name,
        "parameters": {"projections": proj_params, "all": all_params},
        "checkpoint_bytes": ckpt_bytes,
        "write_wall_s": written["wall_s"],
        "data": str(data),
        "tokens": tokens,
        "sequences": calibrated.get("sequences"),
        "seq_len": calibrated.get("seq_len"),
        "batch": args.batch,
        "stats_bytes": stats_bytes,
        "budget": float(args.budget) if args.blocks is None else None,
        "blocks": args.blocks,
        "rank": args.rank,
        "decomposed_layers": args.layers or shape.layers,
        "threads": ONE_THREAD,
        "nice": NICE,
        "sequential_run": args.sequential,
        "budgets": limits,
        "phases": rows,
    }
    print(
        f"{shape.name}: {all_params / 1e6:.0f}M parameters, {tokens} calibration tokens "
        f"({result['sequences']} x {result['seq_len']}), statistics {stats_bytes / MiB:.0f} MiB"
    )
    print(
        f"{'phase':<11} {'wall':>8} {'peak RSS':>9} {'budget (tensor)':>16} "
        f"{'budget (projection)':>20}"
    )
    for name, row in rows.items():
        b, ok = row["rss_budget_mb"], row["within_rss_budget"]
        print(
            f"{name + ('*' if row.get('reused') else ''):<11} {row['wall_s']:>7.0f}s {row['peak_rss_mb']:>7.0f}MB "
            f"{b['largest_tensor']:>7.0f}MB {'ok' if ok['largest_tensor'] else 'OVER':>4}     "
            f"{b['largest_projection']:>8.0f}MB {'ok' if ok['largest_projection'] else 'OVER':>4}"
        )
        if "stored_over_dense" in row:
            print(
                f"    stored/dense {row['stored_over_dense']:.4f}, predicted output error "
                f"{row.get('predicted_error', float('nan')):.4f}, measured weight error "
                f"{row.get('measured_weight_error', float('nan')):.4f}"
            )
            for fam, f in row["families"].items():
                if "output_error_mean" in f:
                    print(
                        f"    {fam:<17} {f['form']:<12} output error mean "
                        f"{f['output_error_mean']:.4f} max {f['output_error_max']:.4f}"
                    )
    if any(row.get("reused") for row in rows.values()):
        print("* reused: the figures of the run that made them (--stats)")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
