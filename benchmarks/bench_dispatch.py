"""What one dispatch costs on MAX's CPU runtime: a chain of tiny matmuls, timed by its length.

A decode step at batch 1 is a few hundred small dispatches (per layer: the norms, the
projections, RoPE, the KV-cache write, attention, the residual adds), each moving a few MB at
most. Where the runtime's own cost per dispatch is a sizeable fraction of a kernel's time, fewer
and larger dispatches pay more than faster kernels. This measures that cost directly: graphs
``y = x W W ... W`` (``--chain`` matmuls of ``[1, n] x [n, n]``, ``n = 64``: 16 KiB of weight,
compute negligible) are compiled once each and executed ``--inner`` times in a row, in ABBA
pairs (longest against shortest); the time per dispatch is the slope between the two lengths,
``(t_long - t_short) / (long - short)``. numpy's time for the same chain (one BLAS call and a
Python step per matmul) is printed beside it for scale.

Run: ``uv run python benchmarks/bench_dispatch.py --out dispatch.json`` (two small graphs, about
a minute to compile when the cache is cold).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def chain_graph(length: int, n: int):
    """``x [1, n]`` times ``W [n, n]`` ``length`` times, on the CPU."""
    from max.dtype import DType
    from max.graph import DeviceRef, Graph, TensorType

    dev = DeviceRef.CPU()
    types = [TensorType(DType.float32, [1, n], device=dev)]
    types.append(TensorType(DType.float32, [n, n], device=dev))
    with Graph(f"dispatch_chain_{length}x{n}", input_types=types) as g:
        x, W = (v.tensor for v in g.inputs)
        for _ in range(length):
            x = x @ W
        g.output(x)
    return g


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chain", type=int, nargs=2, default=[1, 128], metavar=("SHORT", "LONG"))
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--inner", type=int, default=200, help="executions per timed sample")
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from max.driver import CPU, Buffer
    from max.engine import InferenceSession

    from attnquant_core import machine_load, paired_ratio, read_load, run_paired

    rng = np.random.default_rng(0)
    W = (rng.standard_normal((args.n, args.n)) / np.sqrt(args.n)).astype(np.float32)
    x = rng.standard_normal((1, args.n)).astype(np.float32)
    session = InferenceSession(devices=[CPU()])
    models, compile_s = {}, {}
    for length in args.chain:
        t0 = time.perf_counter()
        models[length] = session.load(chain_graph(length, args.n))
        compile_s[length] = time.perf_counter() - t0
    xb, Wb = Buffer.from_numpy(x), Buffer.from_numpy(W)
    for length, model in models.items():
        want = x.astype(np.float64)
        for _ in range(length):
            want = want @ W
        got = model.execute(xb, Wb)[0].to_numpy()
        err = float(np.abs(got - want).max() / np.abs(want).max())
        if not err < 1e-4:
            raise SystemExit(f"chain {length}: relative error {err:.2e}")

    def timer(length: int):
        model = models[length]

        def run() -> float:
            t0 = time.perf_counter()
            for _ in range(args.inner):
                model.execute(xb, Wb)
            return (time.perf_counter() - t0) / args.inner

        return run

    short, long = args.chain
    before = read_load()
    runs = run_paired(timer(long), timer(short), pairs=args.pairs, warmup=1)
    load = machine_load(before)
    t_long, t_short = float(np.median(runs.a)), float(np.median(runs.b))
    per_dispatch = (t_long - t_short) / (long - short)
    t0 = time.perf_counter()
    for _ in range(args.inner):
        y = x
        for _ in range(long):
            y = y @ W
    numpy_per_op = (time.perf_counter() - t0) / args.inner / long
    ratio = paired_ratio(list(runs.a), list(runs.b))
    result = {
        "benchmark": "dispatch",
        "n": args.n,
        "chain": args.chain,
        "compile_s": {str(k): v for k, v in compile_s.items()},
        "execute_s": {str(short): t_short, str(long): t_long},
        "long_over_short": ratio.to_json(),
        "per_dispatch_s": per_dispatch,
        "numpy_per_matmul_s": numpy_per_op,
        "load": load.to_json(),
    }
    print(
        f"MAX CPU: one execute of {short} matmul(s) {t_short * 1e6:.1f} us, of {long} "
        f"{t_long * 1e6:.1f} us: {per_dispatch * 1e6:.2f} us a dispatch "
        f"([1, {args.n}] x [{args.n}, {args.n}]); numpy {numpy_per_op * 1e6:.2f} us a matmul; "
        f"{load.describe()}"
    )
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
