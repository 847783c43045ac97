"""Throughput of each execution path against the stock model, on the embedded demo model.

For every path attnquant-max implements (precompute-outside; the in-graph GEMM and
fold-in-graph paths, the custom op and NVFP4 where they exist), the demo model is decomposed at
passthrough and served in-process beside the stock dense model, timed as ``attnquant bench`` times
it (adjacent pairs in ABBA order after a discarded warm-up run of each; THETA/BASE as the
geometric mean of the within-pair ratios with a bootstrap-over-pairs 95% CI): decode and prefill
tokens per second, with the machine's load beside each path. A path that is not implemented yet
is listed with the reason instead of a number.

Run: ``uv run --all-packages --group bench python benchmarks/bench_paths.py`` (or
``uv run nox -s bench``).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

PATHS = {
    "precompute-outside": {"path": "precompute-outside"},
    "gemm (in-graph)": {"path": "gemm"},
    "gemm, no q/k/v fusion": {"path": "gemm", "qkv_fuse": False},
    "fold in graph (--path precompute)": {"path": "precompute"},
    "custom op": {"path": "custom-op"},
    "nvfp4": {"path": "precompute-outside", "quant": "nvfp4"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--repetitions", type=int, default=10, help="timed pairs per path")
    parser.add_argument("--warmup", type=int, default=1, help="discarded runs of each model")
    parser.add_argument("--blocks", default="layers", help="G of the theta checkpoint")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument(
        "--only", nargs="+", choices=list(PATHS), help="measure these paths only (default: all)"
    )
    args = parser.parse_args()

    from attnquant_cli import demo_model_path
    from attnquant_cli._bench import bench_pair, generate_runner, prompt_ids, summarize
    from attnquant_core import decompose_checkpoint, machine_load, read_load
    from attnquant_max import ServingOptions, load_pipeline, require_implemented

    demo = demo_model_path()
    work = Path(tempfile.mkdtemp(prefix="aq-bench-paths-"))
    theta_dir = work / "theta"
    decompose_checkpoint(demo, theta_dir, blocks=args.blocks, rank=args.rank)
    common = {"max_length": 512, "max_batch_size": 8}
    base = load_pipeline(demo, options=ServingOptions(path="precompute-outside"), **common)
    prompt = prompt_ids(base.encode, 128)

    results: dict[str, dict] = {}
    for name, overrides in PATHS.items():
        if args.only and name not in args.only:
            continue
        config = ServingOptions(**overrides)
        try:
            require_implemented(config)
        except NotImplementedError as exc:
            results[name] = {"status": "not implemented", "reason": str(exc)}
            print(f"{name:<40} not implemented")
            continue
        theta = load_pipeline(theta_dir, options=config, **common)
        try:
            before = read_load()
            runs = bench_pair(
                generate_runner(base),
                generate_runner(theta),
                prompt,
                pairs=args.repetitions,
                new_tokens=64,
                warmup=args.warmup,
            )
            load = machine_load(before)
        finally:
            theta.close()
        summary = summarize(runs, gate=0.8, load=load)
        results[name] = {"status": "measured", **summary}
        r = summary["ratios"]["decode_tok_s"]
        p = summary["ratios"]["prefill_tok_s"]
        print(
            f"{name:<40} decode {r['ratio']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}]  "
            f"prefill {p['ratio']:.3f} [{p['ci_low']:.3f}, {p['ci_high']:.3f}]  "
            f"base {summary['medians']['base']['decode_tok_s']:.0f} tok/s; {load.describe()}"
        )
    base.close()
    if args.out:
        payload = {"benchmark": "paths", "blocks": args.blocks, "rank": args.rank, "paths": results}
        args.out.write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
