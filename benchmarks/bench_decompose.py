"""Decomposition speed and memory: attnquant's streamed decomposition against scikit-learn.

Builds a synthetic float32 checkpoint with Gemma-3-1B projection shapes (q 1024x1152, k/v
256x1152, o 1152x1024, gate/up 6912x1152, down 1152x6912), then, each in a fresh process:

* ``ours``: ``attnquant_core.decompose_checkpoint`` at G=1, r=64 (whole pipeline, writes the
  theta checkpoint), with its wall time, the time spent in the SVDs and the peak RSS;
* ``sklearn``: the same band means and row scales, with the residual SVDs done by
  ``sklearn.utils.extmath.randomized_svd`` at the same rank, oversampling and iterations.

Run: ``uv run --all-packages --group bench python benchmarks/bench_decompose.py --layers 26 52``
(or ``uv run nox -s bench``). Each side runs ``--repeats`` times in paired ABBA order; the
table shows medians, the SVD-time ratio with its paired-bootstrap interval
(``attnquant_core.paired_ratio``) and the machine's load, and the JSON (``--out``) every run.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

GEMMA3_1B = {
    "self_attn.q_proj": (1024, 1152),
    "self_attn.k_proj": (256, 1152),
    "self_attn.v_proj": (256, 1152),
    "self_attn.o_proj": (1152, 1024),
    "mlp.gate_proj": (6912, 1152),
    "mlp.up_proj": (6912, 1152),
    "mlp.down_proj": (1152, 6912),
}
RANK, OVERSAMPLES = 64, 10


def make_checkpoint(directory: Path, num_layers: int, seed: int = 0) -> int:
    """Write one safetensors shard per layer; weights = shared part + layer part with decaying spectra."""
    import safetensors.numpy

    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    shared = {f: _spectral(rng, shape) for f, shape in GEMMA3_1B.items()}
    for layer in range(num_layers):
        name = f"model-{layer + 1:05d}-of-{num_layers:05d}.safetensors"
        part = {
            f"model.layers.{layer}.{f}.weight": (shared[f] + _spectral(rng, shape)).astype(
                np.float32
            )
            for f, shape in GEMMA3_1B.items()
        }
        safetensors.numpy.save_file(part, directory / name)
        weight_map.update(dict.fromkeys(part, name))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps({"architectures": ["Gemma3ForCausalLM"]}))
    return max(o * i for o, i in GEMMA3_1B.values()) * 4


def _spectral(rng: np.random.Generator, shape: tuple[int, int], k: int = 256) -> np.ndarray:
    """A random matrix whose singular values decay like 1/(1+i/16), plus a small flat floor."""
    out_dim, in_dim = shape
    left = rng.standard_normal((out_dim, k), dtype=np.float32)
    right = rng.standard_normal((k, in_dim), dtype=np.float32)
    left *= (1.0 / (1.0 + np.arange(k) / 16.0)).astype(np.float32)
    W = left @ right / np.float32(np.sqrt(in_dim))
    W += np.float32(0.02) * rng.standard_normal(shape, dtype=np.float32)
    return W


def _peak_rss_mb() -> float:
    """This process's peak resident set (VmHWM): unlike ``ru_maxrss`` it is reset at exec, so a
    worker does not inherit the parent's peak through fork."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # not Linux: KiB on Linux


def worker_ours(src: Path, out: Path) -> dict:
    import attnquant_core.fit._decompose as dec  # private on purpose: its truncated_svd is timed
    from attnquant_core import decompose_checkpoint, truncated_svd

    svd_time = [0.0]

    def timed_svd(*args, **kwargs):
        t = time.perf_counter()
        try:
            return truncated_svd(*args, **kwargs)
        finally:
            svd_time[0] += time.perf_counter() - t

    dec.truncated_svd = timed_svd  # count SVD time inside the real pipeline
    t0 = time.perf_counter()
    manifest = decompose_checkpoint(src, out, blocks=1, rank=RANK)
    wall = time.perf_counter() - t0
    errors = [e for f in manifest["families"].values() for e in f["errors"]]
    norms = [n for f in manifest["families"].values() for n in f["norms"]]
    return {
        "wall_s": wall,
        "svd_s": svd_time[0],
        "error": float(
            np.sqrt(
                sum((e * n) ** 2 for e, n in zip(errors, norms, strict=True))
                / sum(n * n for n in norms)
            )
        ),
        "peak_rss_mb": _peak_rss_mb(),
    }


def worker_sklearn(src: Path) -> dict:
    from sklearn.utils.extmath import randomized_svd

    from attnquant_core import open_checkpoint, row_scale

    ckpt = open_checkpoint(src)
    svd_time = 0.0
    num = den = 0.0
    t0 = time.perf_counter()
    for info in ckpt.families.values():
        acc = np.zeros(info.shape, np.float32)
        for key in info.keys:
            acc += ckpt.get(key)
        W0 = acc / np.float32(len(info.keys))
        del acc
        n_iter = 7 if 0.1 * min(info.shape) > RANK else 4  # what "auto" resolves to on both sides
        for key in info.keys:
            W = ckpt.get(key)
            s = row_scale(W, W0)
            R = W - s[:, None] * W0
            t = time.perf_counter()
            U, S, Vt = randomized_svd(
                R, RANK, n_oversamples=OVERSAMPLES, n_iter=n_iter, random_state=0
            )
            svd_time += time.perf_counter() - t
            R -= (U * S) @ Vt
            num += float(np.linalg.norm(R)) ** 2
            den += float(np.linalg.norm(W)) ** 2
    return {
        "wall_s": time.perf_counter() - t0,
        "svd_s": svd_time,
        "error": float(np.sqrt(num / den)),
        "peak_rss_mb": _peak_rss_mb(),
    }


def _median(runs: list[dict]) -> dict:
    return {k: float(np.median([r[k] for r in runs])) for k in runs[0]}


def _spawn(*args: str) -> dict:
    done = subprocess.run(
        [sys.executable, __file__, *args], check=True, capture_output=True, text=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[26, 52])
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--workdir", type=Path, help="where the synthetic checkpoints go")
    parser.add_argument(
        "--repeats", type=int, default=2, help="paired runs of each side (ABBA order)"
    )
    parser.add_argument("--worker", choices=["ours", "sklearn"], help=argparse.SUPPRESS)
    parser.add_argument("--src", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--dst", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "ours":
        print(json.dumps(worker_ours(args.src, args.dst)))
        return
    if args.worker == "sklearn":
        print(json.dumps(worker_sklearn(args.src)))
        return

    import threadpoolctl

    from attnquant_core import machine_load, paired_ratio, read_load, run_paired

    blas = threadpoolctl.threadpool_info()
    rows = []
    for L in args.layers:
        work = Path(tempfile.mkdtemp(prefix=f"aq-bench-{L}-", dir=args.workdir))
        try:
            largest = make_checkpoint(work / "src", L)

            def run_ours(work: Path = work) -> dict:
                shutil.rmtree(work / "theta", ignore_errors=True)
                return _spawn(
                    "--worker", "ours", "--src", str(work / "src"), "--dst", str(work / "theta")
                )

            def run_sklearn(work: Path = work) -> dict:
                return _spawn("--worker", "sklearn", "--src", str(work / "src"))

            # Paired runs in ABBA order (each run its own process, so no warm-up to discard):
            # drift in machine load hits both sides of a pair alike.
            before = read_load()
            paired = run_paired(run_ours, run_sklearn, pairs=args.repeats, warmup=0)
            load = machine_load(before)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        runs = {"ours": list(paired.a), "sklearn": list(paired.b)}
        ratios = {
            key: paired_ratio([r[key] for r in paired.a], [r[key] for r in paired.b])
            for key in ("svd_s", "wall_s")
        }
        ours, ref = _median(runs["ours"]), _median(runs["sklearn"])
        budget = 300 + 4 * largest / 2**20
        rows.append(
            {
                "layers": L,
                "repeats": args.repeats,
                "largest_weight_mb": largest / 2**20,
                "rss_budget_mb": budget,
                "ours": ours,
                "sklearn": ref,
                "runs": runs,
                "order": paired.order_string(),
                "svd_time_ratio_ours_over_sklearn": ratios["svd_s"].to_json(),
                "wall_ratio_ours_over_sklearn": ratios["wall_s"].to_json(),
                "load": load.to_json(),
                "load_summary": load.describe(),
                "within_rss_budget": ours["peak_rss_mb"] < budget,
            }
        )
    print(
        f"{'L':>3} {'ours wall':>10} {'ours svd':>9} {'skl wall':>9} {'skl svd':>8} "
        f"{'svd ratio':>9} {'ours err':>9} {'skl err':>9} {'ours RSS':>9} {'budget':>7}"
    )
    for r in rows:
        o, s = r["ours"], r["sklearn"]
        svd = r["svd_time_ratio_ours_over_sklearn"]
        print(
            f"{r['layers']:>3} {o['wall_s']:>9.1f}s {o['svd_s']:>8.1f}s {s['wall_s']:>8.1f}s "
            f"{s['svd_s']:>7.1f}s {svd['ratio']:>9.3f} {o['error']:>9.5f} "
            f"{s['error']:>9.5f} {o['peak_rss_mb']:>7.0f}MB {r['rss_budget_mb']:>5.0f}MB"
        )
        print(
            f"    svd ratio {svd['ratio']:.3f} [{svd['ci_low']:.3f}, {svd['ci_high']:.3f}] over "
            f"{r['repeats']} pairs ({r['order']}); {r['load_summary']}"
        )
    result = {"benchmark": "decompose", "rank": RANK, "blocks": 1, "blas": blas, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
