"""Per-layer latency of the custom op (generated_linear / generated_mlp) against the GEMM formulation.

One decoder layer's projections of a small Llama-shaped model: hidden 1024, 16 query heads and
4 key/value heads of 64 (q 1024x1024, k/v 256x1024, o 1024x1024), MLP intermediate 4096
(gate/up 4096x1024, down 1024x4096), SiLU; float32 weights, random theta tensors at ranks 4, 16
and 64; batch (tokens) 1 and 16. Attention itself, norms and residuals are left out: they are the
same on both paths.

* ``custom``: q, k, v, o as four ``generated_linear`` dispatches and the MLP as one
  ``generated_mlp`` (``ATTNQUANT_FUSED_MLP=1``).
* ``gemm``: the GEMM formulation of ``attnquant_max._layers`` (docs/serving-paths.md): per group one matmul
  ``x @ W0V^T`` over ``[W0 ; V^T]`` (q/k/v fused, gate/up fused, o and down alone), then the
  block-diagonal up-projection ``@ U^T`` built in the graph from the members' ``U`` as
  ``ThetaStackedLinear`` does, ``s *`` the first columns, ``silu(gate) * up``.

The theta tensors are graph inputs (as weights are in a served model), every weight dimension
static and the batch dimension symbolic, so one compiled graph per (path, rank) serves both
batch sizes: 6 compiles, cached by MAX across runs. Both paths are checked against each other
before timing (the random theta tensors and the float64 reference are those of
``attnquant_kernels.testing``). Each sample is the mean latency of ``--inner`` back-to-back executions;
the paths are timed in adjacent pairs, ABBA order, after a discarded warm-up sample of each, and the
table gives medians and custom/GEMM (geometric mean of the within-pair ratios, < 1 means the
custom op is faster) with a bootstrap-over-pairs 95% CI, as ``attnquant bench`` computes it
(``attnquant_core.paired_ratio``), and the machine's load during each case.

``--sections nvfp4`` (every section runs by default) times one NVFP4 projection of Llama-like
shapes instead: the fused ``generated_linear_nvfp4`` op against dequantize-in-graph-then-matmul
(today's ``ATTNQUANT_QUANT=nvfp4``) and the float32 matmul, with the weight bytes each moves and
their roofline over a measured memory bandwidth (``benchmarks/kernels_nvfp4.py``; CPU only).
``--sections lowrank`` times one projection without ``W0`` (``W = U V^T`` at ``--lowrank-ratio``
of the dense bytes): ``generated_lowrank`` against the GEMM path's two matmuls and the dense
float32 matmul (``benchmarks/kernels_lowrank.py``; CPU only).

On the CPU by default. ``--device gpu`` builds both graphs on ``DeviceRef.GPU()`` (MAX compiles
the kernels' GPU variant and its own GPU matmuls), keeps every input on the accelerator, and
waits for the device (``synchronize``) before each sample's clock stops. There a path that
misses the 1e-4 check is reported (and the exit status is 1) after the timings are written,
rather than stopping the run: the errors are in the JSON (``max_rel_error``).

Run: ``uv run --all-packages --group bench python benchmarks/bench_kernels.py`` (or
``uv run nox -s bench``); ``--out FILE`` writes the JSON (``nox -s bench`` gathers it into
``bench-results/results.json``; it is rewritten after every case, so a run stopped early keeps
what it measured). On a GPU machine: ``scripts/gpu_check.sh``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

from attnquant_kernels.testing import apply, max_rel_error, mlp_ref, silu
from attnquant_kernels.testing import theta as random_theta

HIDDEN, Q_OUT, KV_OUT, INTERMEDIATE = 1024, 1024, 256, 4096
# (name, out, in) of the four attention projections; o reads a hidden-sized input.
ATTENTION = (
    ("q", Q_OUT, HIDDEN),
    ("k", KV_OUT, HIDDEN),
    ("v", KV_OUT, HIDDEN),
    ("o", HIDDEN, Q_OUT),
)
MLP = (("gate", INTERMEDIATE, HIDDEN), ("up", INTERMEDIATE, HIDDEN), ("down", HIDDEN, INTERMEDIATE))


def make_theta(rank: int, seed: int = 0) -> dict[str, tuple[np.ndarray, ...]]:
    """``name -> (W0, s, U, V)`` for the seven projections, float32, roughly unit-scaled outputs."""
    rng = np.random.default_rng(seed)
    return {
        name: tuple(random_theta(rng, out_dim, in_dim, rank))
        for name, out_dim, in_dim in ATTENTION + MLP
    }


def custom_inputs(theta: dict) -> list[np.ndarray]:
    return [a for name, *_ in ATTENTION + MLP for a in theta[name]]


def gemm_inputs(theta: dict) -> list[np.ndarray]:
    """Per group ``W0V = [W0 of each member ; V^T of each member]``, ``s`` and ``U`` per member."""
    arrays = []
    for group in (("q", "k", "v"), ("o",), ("gate", "up"), ("down",)):
        rows = [theta[n][0] for n in group] + [theta[n][3].T for n in group]
        arrays.append(np.ascontiguousarray(np.concatenate(rows, axis=0)))
        for n in group:
            arrays += [theta[n][1], theta[n][2]]
    return arrays


def build_graph(path: str, rank: int, device: str = "cpu"):
    """The layer's projections on ``path`` ("custom" or "gemm") at ``rank``, batch symbolic.

    ``device`` is ``"cpu"`` or ``"gpu"``: where every input and op of the graph is placed.
    """
    from max.dtype import DType
    from max.graph import DeviceRef, Graph, TensorType, ops

    from attnquant_kernels import kernels_path

    dev = DeviceRef.GPU() if device == "gpu" else DeviceRef.CPU()

    def tt(*shape):
        return TensorType(DType.float32, list(shape), device=dev)

    x_type = tt("batch", HIDDEN)
    if path == "custom":
        from attnquant_kernels.graph import generated_linear, generated_mlp

        types = [x_type]
        for _, out_dim, in_dim in ATTENTION + MLP:
            types += [tt(out_dim, in_dim), tt(out_dim), tt(out_dim, rank), tt(in_dim, rank)]
        with Graph(f"custom_r{rank}", input_types=types, custom_extensions=[kernels_path()]) as g:
            x, *w = (v.tensor for v in g.inputs)
            outs = [generated_linear(x, *w[4 * i : 4 * i + 4]) for i in range(4)]
            outs.append(generated_mlp(x, w[16:20], w[20:24], w[24:28], activation="silu"))
            g.output(*outs)
        return g

    groups = [
        [("q", Q_OUT), ("k", KV_OUT), ("v", KV_OUT)],
        [("o", HIDDEN)],
        [("gate", INTERMEDIATE), ("up", INTERMEDIATE)],
        [("down", HIDDEN)],
    ]
    in_dims = [HIDDEN, Q_OUT, HIDDEN, INTERMEDIATE]
    types = [x_type]
    for members, in_dim in zip(groups, in_dims, strict=True):
        outs_total = sum(o for _, o in members)
        types.append(tt(outs_total + len(members) * rank, in_dim))
        for _, out_dim in members:
            types += [tt(out_dim), tt(out_dim, rank)]

    def stacked(x, W0V, members, params):
        # attnquant_max._layers.ThetaStackedLinear on the GEMM path, slot 0.
        out_total = sum(o for _, o in members)
        h = x @ W0V.T
        s = ops.concat([params[2 * i] for i in range(len(members))])
        y = h[:, :out_total] * s
        if rank:
            rows = []
            for p, (_, out_dim) in enumerate(members):
                U = params[2 * p + 1]
                parts = []
                if p:
                    parts.append(
                        ops.broadcast_to(ops.constant(0, DType.float32, dev), [out_dim, p * rank])
                    )
                parts.append(U)
                if p < len(members) - 1:
                    width = (len(members) - 1 - p) * rank
                    parts.append(
                        ops.broadcast_to(ops.constant(0, DType.float32, dev), [out_dim, width])
                    )
                rows.append(ops.concat(parts, axis=1) if len(parts) > 1 else U)
            up = ops.concat(rows, axis=0) if len(rows) > 1 else rows[0]
            k_r = len(members) * rank
            y = y + h[:, out_total : out_total + k_r] @ up.T
        return y

    with Graph(f"gemm_r{rank}", input_types=types) as g:
        x, *w = (v.tensor for v in g.inputs)
        outs, i = [], 0
        results = []
        for members in groups:
            n = len(members)
            results.append((members, w[i], w[i + 1 : i + 1 + 2 * n]))
            i += 1 + 2 * n
        qkv = stacked(x, results[0][1], results[0][0], results[0][2])
        q, k, v = ops.split(qkv, [Q_OUT, KV_OUT, KV_OUT], axis=-1)
        o = stacked(x, results[1][1], results[1][0], results[1][2])
        gu = stacked(x, results[2][1], results[2][0], results[2][2])
        gate, up = ops.split(gu, [INTERMEDIATE, INTERMEDIATE], axis=-1)
        down = stacked(ops.silu(gate) * up, results[3][1], results[3][0], results[3][2])
        outs = [q, k, v, o, down]
        g.output(*outs)
    return g


def reference(theta: dict, x: np.ndarray) -> list[np.ndarray]:
    """The numpy identity in float64: q, k, v, o (of x) and the MLP."""
    outs = [apply(x, *theta[n]) for n in ("q", "k", "v", "o")]
    outs.append(mlp_ref(x, theta["gate"], theta["up"], theta["down"], silu))
    return outs


def _shapes(specs: list[str] | None) -> list[tuple[int, int]] | None:
    """``OUTxIN`` strings as ``(out, in)`` pairs (``None``: the section's defaults)."""
    if not specs:
        return None
    try:
        return [(int(o), int(i)) for o, i in (spec.lower().split("x") for spec in specs)]
    except ValueError:
        raise SystemExit(f"shapes: expected OUTxIN such as 4096x1024, got {specs}") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument(
        "--repetitions", type=int, default=15, help="timed pairs (one sample of each path) per case"
    )
    parser.add_argument("--inner", type=int, default=10, help="executions averaged per sample")
    parser.add_argument(
        "--sections",
        nargs="+",
        choices=("theta", "nvfp4", "lowrank"),
        default=["theta", "nvfp4", "lowrank"],
        help="theta: one layer, custom op vs GEMM; nvfp4: one NVFP4 projection; lowrank: one "
        "projection without W0, generated_lowrank vs two matmuls (both CPU only)",
    )
    parser.add_argument(
        "--lowrank-ratio",
        type=float,
        default=0.5,
        help="lowrank section: the factors' bytes over the dense weight's (sets each rank)",
    )
    parser.add_argument(
        "--lowrank-shapes",
        nargs="+",
        metavar="OUTxIN",
        help="projection shapes of the lowrank section (default: 1024x1024 4096x1024 1024x4096)",
    )
    parser.add_argument(
        "--bandwidth-mib", type=int, default=1024, help="array copied to measure bandwidth"
    )
    parser.add_argument(
        "--nvfp4-shapes",
        nargs="+",
        metavar="OUTxIN",
        help="projection shapes of the nvfp4 section (default: 2048x2048 8192x2048 2048x8192)",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "gpu"),
        default="cpu",
        help="where the graphs run (gpu: the first accelerator MAX sees)",
    )
    args = parser.parse_args()

    from max.driver import CPU, Buffer
    from max.engine import InferenceSession

    from attnquant_core import machine_load, paired_ratio, read_load, run_paired
    from attnquant_kernels import check_rank

    for r in args.ranks:
        check_rank(r, op="bench_kernels")
    on_gpu = args.device == "gpu"
    if on_gpu:
        from max.driver import Accelerator, accelerator_count

        if accelerator_count() == 0:
            raise SystemExit("bench_kernels --device gpu: MAX sees no accelerator")
        device = Accelerator()
    else:
        device = CPU()
    session = InferenceSession(devices=[device])

    def put(a: np.ndarray) -> Buffer:
        buffer = Buffer.from_numpy(a)
        return buffer.to(device) if on_gpu else buffer

    failures: list[str] = []
    rng = np.random.default_rng(1)
    cases, compile_s = [], {}
    nvfp4: dict = {}
    if "theta" not in args.sections:
        args.ranks = []
    else:
        print(
            f"{'rank':>4} {'batch':>5} {'custom ms':>10} {'GEMM ms':>10} "
            f"{'custom/GEMM':>11} {'95% CI':>17}  load"
        )
    for rank in args.ranks:
        theta = make_theta(rank)
        models, inputs = {}, {}
        for path in ("custom", "gemm"):
            t0 = time.perf_counter()
            models[path] = session.load(build_graph(path, rank, args.device))
            compile_s[f"{path}_r{rank}"] = time.perf_counter() - t0
            arrays = custom_inputs(theta) if path == "custom" else gemm_inputs(theta)
            inputs[path] = [put(a) for a in arrays]
        for batch in args.batches:
            x = rng.standard_normal((batch, HIDDEN), dtype=np.float32)
            xb = put(x)
            ref = reference(theta, x)
            errors: dict[str, dict[str, float]] = {}
            for path, model in models.items():  # correctness first, and warm-up
                got = [o.to_numpy() for o in model.execute(xb, *inputs[path])]  # to the host
                errors[path] = {}
                for name, a, b in zip(("q", "k", "v", "o", "mlp"), got, ref, strict=True):
                    err = max_rel_error(a, b)
                    errors[path][name] = err
                    if not err <= 1e-4:
                        message = f"{path} r={rank} batch={batch} {name}: rel. error {err:.2e}"
                        if not on_gpu:
                            raise SystemExit(message)
                        failures.append(message)
                        print(f"CHECK FAILED: {message}")

            def timer(model, ins: list, xb=xb):
                def run() -> float:
                    t0 = time.perf_counter()
                    for _ in range(args.inner):
                        model.execute(xb, *ins)
                    if on_gpu:
                        device.synchronize()  # launches are asynchronous
                    return (time.perf_counter() - t0) / args.inner

                return run

            before = read_load()
            runs = run_paired(
                timer(models["custom"], inputs["custom"]),
                timer(models["gemm"], inputs["gemm"]),
                pairs=args.repetitions,
                warmup=1,
            )
            load = machine_load(before)
            samples = {"custom": list(runs.a), "gemm": list(runs.b)}
            est = paired_ratio(samples["custom"], samples["gemm"])
            med = {p: float(np.median(v)) * 1e3 for p, v in samples.items()}
            cases.append(
                {
                    "rank": rank,
                    "batch": batch,
                    "median_ms": med,
                    "custom_over_gemm": est.to_json(),
                    "pairs": runs.pairs,
                    "warmup_runs": runs.warmup,
                    "order": runs.order_string().replace("A", "C").replace("B", "G"),
                    "load": load.to_json(),
                    "max_rel_error": errors,
                    "samples_s": samples,
                }
            )
            print(
                f"{rank:>4} {batch:>5} {med['custom']:>10.3f} {med['gemm']:>10.3f} "
                f"{est.ratio:>11.3f} [{est.low:>6.3f}, {est.high:>6.3f}]  {load.describe()}"
            )
            if args.out:
                write_results(args, device, compile_s, cases, failures)
    if "nvfp4" in args.sections and on_gpu:
        print("the nvfp4 section runs on the CPU only; skipped")
    elif "nvfp4" in args.sections:
        from kernels_nvfp4 import run_section

        nvfp4_cases: list[dict] = []

        def on_case(case: dict) -> None:
            nvfp4_cases.append(case)
            if args.out:
                write_results(args, device, compile_s, cases, failures, {"cases": nvfp4_cases})

        nvfp4 = run_section(
            session,
            batches=args.batches,
            repetitions=args.repetitions,
            inner=args.inner,
            bandwidth_mib=args.bandwidth_mib,
            compile_s=compile_s,
            on_case=on_case,
            shapes=_shapes(args.nvfp4_shapes),
        )
    lowrank: dict = {}
    if "lowrank" in args.sections and on_gpu:
        print("the lowrank section runs on the CPU only; skipped")
    elif "lowrank" in args.sections:
        from kernels_lowrank import run_section as run_lowrank

        lowrank_cases: list[dict] = []

        def on_lowrank(case: dict) -> None:
            lowrank_cases.append(case)
            if args.out:
                write_results(
                    args, device, compile_s, cases, failures, nvfp4, {"cases": lowrank_cases}
                )

        lowrank = run_lowrank(
            session,
            batches=args.batches,
            repetitions=args.repetitions,
            inner=args.inner,
            bandwidth_mib=args.bandwidth_mib,
            ratio=args.lowrank_ratio,
            compile_s=compile_s,
            on_case=on_lowrank,
            shapes=_shapes(args.lowrank_shapes),
        )
    print("compile + load (s): " + ", ".join(f"{k} {v:.1f}" for k, v in compile_s.items()))
    if args.out:
        write_results(args, device, compile_s, cases, failures, nvfp4, lowrank)
    if failures:
        raise SystemExit(f"{len(failures)} correctness check(s) failed: " + "; ".join(failures))


def write_results(
    args,
    device,
    compile_s: dict,
    cases: list,
    failures: list[str],
    nvfp4: dict | None = None,
    lowrank: dict | None = None,
) -> None:
    """The JSON results file (``--out``), rewritten after every case."""
    machine = {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count()}
    if args.device == "gpu":
        from max.driver import accelerator_api, accelerator_architecture_name

        machine["accelerator"] = {
            "api": accelerator_api(),
            "architecture": accelerator_architecture_name(),
            "label": str(device.label),
        }
    payload = {
        "benchmark": "kernels",
        "model": {
            "hidden": HIDDEN,
            "q_out": Q_OUT,
            "kv_out": KV_OUT,
            "intermediate": INTERMEDIATE,
            "dtype": "float32",
            "activation": "silu",
        },
        "device": args.device,
        "machine": machine,
        "repetitions": args.repetitions,
        "inner": args.inner,
        "ratio": (
            "custom/GEMM latency (geometric mean of within-pair ratios, ABBA pairs, bootstrap over"
            " pairs 95% CI); < 1: custom op faster"
        ),
        "compile_load_s": compile_s,
        "correctness_failures": failures,
        "cases": cases,
        "nvfp4": nvfp4 or {},
        "lowrank": lowrank or {},
    }
    args.out.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
