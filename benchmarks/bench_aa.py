"""A/A check of the bench statistics: the demo model against itself, repeated, on this machine.

BASE is the embedded demo model, THETA the demo decomposed at passthrough (``--blocks layers
--rank 0``): precompute-outside serves it as the identical stock graph, so the true THETA/BASE is
1.0 and a 95% interval should hold 1.0 in 19 runs of 20. Both models are loaded once (one
compile each); then ``--runs`` independent bench runs are made, each of ``--pairs`` ABBA pairs
after ``--warmup`` discarded runs per model, as ``attnquant bench`` times them. For each run and
each metric (decode and prefill tok/s) the script computes from the same samples

* the paired interval ``attnquant bench`` uses now (geometric mean of within-pair ratios,
  expanded percentile bootstrap over pairs: ``attnquant_core.paired_ratio``), and
* the unpaired one it used up to 0.2 (ratio of means, percentile bootstrap of each side:
  ``attnquant_core.unpaired_ratio``),

counts the intervals holding 1.0 for each, and records the machine's load (1-minute load
average before and after, CPU busy and stolen time) beside every run.

Run: ``python benchmarks/bench_aa.py --runs 20 --out aa.json`` (``HF_HUB_OFFLINE=1``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

METRICS = ("decode_tok_s", "prefill_tok_s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="independent A/A bench runs")
    parser.add_argument("--pairs", type=int, default=10, help="ABBA pairs per run")
    parser.add_argument("--warmup", type=int, default=1, help="discarded runs per model per run")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    if args.pairs < 2:
        parser.error(f"--pairs must be at least 2, got {args.pairs}")

    from attnquant_cli import demo_model_path
    from attnquant_cli._bench import bench_pair, generate_runner, prompt_ids
    from attnquant_core import (
        decompose_checkpoint,
        machine_load,
        paired_ratio,
        read_load,
        unpaired_ratio,
    )
    from attnquant_max import ServingOptions, load_pipeline

    started = read_load()
    t0 = time.perf_counter()
    demo = demo_model_path()
    passthrough = Path(tempfile.mkdtemp(prefix="aq-bench-aa-")) / "pass"
    decompose_checkpoint(demo, passthrough, blocks="layers", rank=0)
    config = ServingOptions.from_env()
    common = {"max_length": 512, "max_batch_size": 8, "devices": "cpu"}
    base = load_pipeline(demo, options=replace(config, blocks=None), **common)
    theta = load_pipeline(passthrough, options=config, **common)
    setup_s = time.perf_counter() - t0
    print(
        f"decomposed and loaded both models in {setup_s:.0f} s; {machine_load(started).describe()}"
    )
    prompt = prompt_ids(base.encode, args.prompt_tokens)

    runs: list[dict] = []
    header = f"{'run':>3}  {'metric':<8} {'paired [95% CI]':<26} {'unpaired [95% CI]':<26} load"
    print(header)
    try:
        for run in range(args.runs):
            before = read_load()
            paired = bench_pair(
                generate_runner(base),
                generate_runner(theta),
                prompt,
                pairs=args.pairs,
                new_tokens=args.new_tokens,
                warmup=args.warmup,
            )
            load = machine_load(before)
            record: dict = {
                "run": run,
                "pairs": paired.pairs,
                "warmup_runs": {"base": paired.warmup, "theta": paired.warmup},
                "order": paired.order_string().replace("A", "T"),
                "load": load.to_json(),
                "samples": {
                    "theta": [s.__dict__ for s in paired.a],
                    "base": [s.__dict__ for s in paired.b],
                },
            }
            for metric in METRICS:
                a = [getattr(s, metric) for s in paired.a]
                b = [getattr(s, metric) for s in paired.b]
                new = paired_ratio(a, b, seed=run)
                old = unpaired_ratio(a, b, seed=run)
                record[metric] = {"paired": new.to_json(), "unpaired": old.to_json()}
                print(
                    f"{run:>3}  {metric.split('_')[0]:<8} "
                    f"{new.ratio:.3f} [{new.low:.3f}, {new.high:.3f}]{'  ' if new.contains() else ' *'}"
                    f"      {old.ratio:.3f} [{old.low:.3f}, {old.high:.3f}]"
                    f"{'  ' if old.contains() else ' *'}      {load.describe()}",
                    flush=True,
                )
            runs.append(record)
            if args.out:
                write(args, runs, setup_s, started)
    finally:
        base.close()
        theta.close()
    summary = summarize(runs)
    for metric, s in summary["metrics"].items():
        print(
            f"{metric}: 1.0 inside {s['paired_contains_1']}/{len(runs)} paired intervals "
            f"(median half-width {s['paired_median_half_width']:.3f}), "
            f"{s['unpaired_contains_1']}/{len(runs)} unpaired "
            f"(median half-width {s['unpaired_median_half_width']:.3f})"
        )
    print(f"load over the runs: {summary['load']}")
    if args.out:
        write(args, runs, setup_s, started)
        print(f"wrote {args.out}")


def summarize(runs: list[dict]) -> dict:
    """Per metric: how many paired and unpaired intervals hold 1.0, and their median half-widths."""
    metrics = {}
    for metric in METRICS:
        out = {}
        for method in ("paired", "unpaired"):
            ests = [r[metric][method] for r in runs]
            out[f"{method}_contains_1"] = sum(e["ci_low"] <= 1.0 <= e["ci_high"] for e in ests)
            out[f"{method}_median_half_width"] = float(np.median([e["half_width"] for e in ests]))
            out[f"{method}_median_ratio"] = float(np.median([e["ratio"] for e in ests]))
        metrics[metric] = out
    before = [r["load"]["loadavg_before"][0] for r in runs if r["load"]["loadavg_before"]]
    after = [r["load"]["loadavg_after"][0] for r in runs if r["load"]["loadavg_after"]]
    steal = [r["load"]["steal_fraction"] for r in runs if r["load"]["steal_fraction"] is not None]
    busy = [r["load"]["busy_fraction"] for r in runs if r["load"]["busy_fraction"] is not None]
    load = {
        "loadavg_1min_range": [min(before + after), max(before + after)] if before else None,
        "steal_fraction_max": max(steal) if steal else None,
        "busy_fraction_median": float(np.median(busy)) if busy else None,
    }
    return {"runs": len(runs), "metrics": metrics, "load": load}


def write(args: argparse.Namespace, runs: list[dict], setup_s: float, started) -> None:
    """The JSON results file, rewritten after every run (a run stopped early keeps what it has)."""
    from attnquant_core import machine_load

    payload = {
        "benchmark": "aa",
        "base": "demo",
        "theta": "demo decomposed at passthrough (blocks=layers, rank=0), precompute-outside",
        "true_ratio": 1.0,
        "pairs": args.pairs,
        "warmup": args.warmup,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "machine": {
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
        },
        "setup_s": setup_s,
        "load_whole_script": machine_load(started).to_json(),
        "summary": summarize(runs),
        "runs": runs,
    }
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    tmp.replace(args.out)


if __name__ == "__main__":
    main()
