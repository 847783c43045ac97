"""The NVFP4 section of ``bench_kernels.py``: one projection held as NVFP4, three ways.

Shapes of a Llama-like model, ``(out, in)``: 2048x2048 (attention), 8192x2048 (gate/up),
2048x8192 (down); batch (tokens) 1 and 16; float32 activations; the weights are graph inputs,
every weight dimension static and the batch symbolic (one compiled graph per path and shape,
cached by MAX across runs).

* ``fused``: ``generated_linear_nvfp4`` (attnquant-kernels), the packed codes decoded inside
  the dot product: reads ``out * in * 9/16`` weight bytes per step (codes and E4M3 scales);
  from 16 rows on, a GEMM over panels of the weight decoded once per call.
* ``deq``: what ``ATTNQUANT_QUANT=nvfp4`` serves today (``attnquant_max._nvfp4_layers``):
  ``dequantize_in_graph`` rebuilds ``W`` in float32 with two gathers and a multiply on every
  forward, then the stock matmul: reads the packed bytes, writes and reads ``W`` (at least
  ``out * in * (9/16 + 8)`` bytes).
* ``dense``: what a long batch (a prefill) runs on an accelerator: ``nvfp4_dequantize``
  (attnquant-kernels) writes ``W^T`` in float32 once, then the stock matmul reads it: reads the
  packed bytes, writes and reads ``W``, as ``deq`` does, but with one SIMD pass instead of
  two gathers.
* ``f32``: the stock float32 matmul ``x @ W^T`` over the same (dequantized) weight: ``4 out in``.

Timing as the rest of the script: samples of ``inner`` back-to-back executions, ``fused`` paired
(ABBA) with each of the others, ratios by :func:`attnquant_core.paired_ratio` (< 1: fused
faster). The roofline of a path is its weight bytes over the memory bandwidth measured here with
a numpy copy of a large array (bytes read plus written over the copy time; numpy copies on one
thread, the kernels run on every core, so the roofline is a single-thread one). Every path is
checked against ``x @ dequantize(W)^T`` (numpy, float64) to 1e-4 before it is timed. CPU only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from attnquant_kernels.testing import max_rel_error, nvfp4_dequantize, nvfp4_random

#: ``(out, in)`` of the projections timed.
SHAPES: tuple[tuple[int, int], ...] = ((2048, 2048), (8192, 2048), (2048, 8192))
PATHS = ("fused", "deq", "dense", "f32")
#: The paths timed against ``fused``, each in its own ABBA pairs.
OTHERS = PATHS[1:]


def weight_bytes(path: str, out_dim: int, in_dim: int) -> int:
    """Weight bytes one execution of ``path`` moves (reads, plus the write of ``W`` by the
    ``deq`` and ``dense`` paths)."""
    packed = out_dim * in_dim // 2 + out_dim * in_dim // 16 + 4
    dense = 4 * out_dim * in_dim
    return {"fused": packed, "deq": packed + 2 * dense, "dense": packed + 2 * dense, "f32": dense}[
        path
    ]


def memory_bandwidth(mib: int = 1024, repeats: int = 5) -> float:
    """Bytes per second of ``np.copyto`` over a ``mib`` MiB float32 array: the best of ``repeats``
    copies, counting the bytes read and the bytes written."""
    n = mib * (1 << 20) // 4
    src = np.ones(n, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(repeats))
    return 2 * src.nbytes / best


def read_bandwidth(mib: int = 1024, repeats: int = 5) -> float:
    """Bytes per second a float32 matrix-vector product over a ``mib`` MiB matrix reads (numpy's
    BLAS, on every core it is given): the best of ``repeats``. What a batch-1 decode step does to
    its weights, where :func:`memory_bandwidth` also writes and runs on one thread."""
    cols = 1024
    matrix = np.ones((mib * (1 << 20) // 4 // cols, cols), np.float32)
    vector = np.ones(cols, np.float32)
    matrix @ vector  # fault the pages in
    best = min(_timed(lambda: matrix @ vector) for _ in range(repeats))
    return matrix.nbytes / best


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def build_graph(path: str, out_dim: int, in_dim: int):
    """One projection on ``path`` for ``x [batch, in]`` (float32), on the CPU."""
    from max.dtype import DType
    from max.graph import DeviceRef, Graph, TensorType

    from attnquant_kernels import kernels_path

    dev = DeviceRef.CPU()
    x_type = TensorType(DType.float32, ["batch", in_dim], device=dev)
    name = f"nvfp4_{path}_{out_dim}x{in_dim}"
    if path == "f32":
        types = [x_type, TensorType(DType.float32, [out_dim, in_dim], device=dev)]
        with Graph(name, input_types=types) as g:
            x, W = (v.tensor for v in g.inputs)
            g.output(x @ W.T)
        return g
    types = [
        x_type,
        TensorType(DType.uint8, [out_dim, in_dim // 2], device=dev),
        TensorType(DType.uint8, [out_dim, in_dim // 16], device=dev),
        TensorType(DType.float32, [1], device=dev),
    ]
    if path in ("fused", "dense"):
        from attnquant_kernels.graph import generated_linear_nvfp4, nvfp4_dequantize

        with Graph(name, input_types=types, custom_extensions=[kernels_path()]) as g:
            x, w, ws, ws2 = (v.tensor for v in g.inputs)
            if path == "fused":
                g.output(generated_linear_nvfp4(x, w, ws, ws2))
            else:
                g.output(x @ nvfp4_dequantize(w, ws, ws2, transposed=True))
        return g
    from attnquant_max._nvfp4_layers import dequantize_in_graph

    with Graph(name, input_types=types) as g:
        x, w, ws, ws2 = (v.tensor for v in g.inputs)
        g.output(x @ dequantize_in_graph(w, ws, ws2, DType.float32).T)
    return g


def load_paths(
    session: Any,
    arrays: dict[str, list[np.ndarray]],
    build: Callable[[str], Any],
    compile_s: dict[str, float],
    label: str,
) -> tuple[dict[str, Any], dict[str, list]]:
    """Compile ``build(path)`` for every path of ``arrays`` (its weights, as host buffers),
    each compile-and-load time recorded under ``label.format(path)``."""
    from max.driver import Buffer

    models, inputs = {}, {}
    for path, weights in arrays.items():
        t0 = time.perf_counter()
        models[path] = session.load(build(path))
        compile_s[label.format(path)] = time.perf_counter() - t0
        inputs[path] = [Buffer.from_numpy(np.ascontiguousarray(a)) for a in weights]
    return models, inputs


class Timed(NamedTuple):
    """One case of :func:`time_case`: medians (ms), ``base``/other ratios, the paired runs of
    each other path, every path's error, the machine's load over the timing, the samples (s)."""

    median_ms: dict[str, float]
    ratios: dict[str, Any]
    runs: dict[str, Any]
    errors: dict[str, float]
    load: Any
    samples: dict[str, list[float]]


def time_case(
    models: dict[str, Any],
    inputs: dict[str, list],
    xb: Any,
    ref: np.ndarray,
    *,
    base: str,
    others: Sequence[str],
    repetitions: int,
    inner: int,
    what: str,
) -> Timed:
    """Check every path's output against ``ref`` (1e-4 relative), then time ``base`` in ABBA
    pairs with each of ``others``."""
    from attnquant_core import machine_load, paired_ratio, read_load, run_paired

    errors = {}
    for path, model in models.items():
        got = model.execute(xb, *inputs[path])[0].to_numpy()
        errors[path] = max_rel_error(got, ref)
        if not errors[path] <= 1e-4:
            raise SystemExit(f"{what} {path}: rel. error {errors[path]:.2e}")

    def timer(path: str) -> Callable[[], float]:
        model, ins = models[path], inputs[path]

        def run() -> float:
            t0 = time.perf_counter()
            for _ in range(inner):
                model.execute(xb, *ins)
            return (time.perf_counter() - t0) / inner

        return run

    before = read_load()
    runs = {p: run_paired(timer(base), timer(p), pairs=repetitions, warmup=1) for p in others}
    load = machine_load(before)
    samples = {base: [t for r in runs.values() for t in r.a]}
    samples |= {p: list(r.b) for p, r in runs.items()}
    med = {p: float(np.median(v)) * 1e3 for p, v in samples.items()}
    ratios = {p: paired_ratio(list(r.a), list(r.b)) for p, r in runs.items()}
    return Timed(med, ratios, runs, errors, load, samples)


def run_section(
    session: Any,
    *,
    batches: list[int],
    repetitions: int,
    inner: int,
    bandwidth_mib: int,
    compile_s: dict[str, float],
    on_case: Callable[[dict], None],
    shapes: Sequence[tuple[int, int]] | None = None,
) -> dict:
    """Time every shape (``(out, in)``; default :data:`SHAPES`) and batch; ``on_case`` gets
    each case's record as it is measured."""
    from max.driver import Buffer

    bandwidth = memory_bandwidth(bandwidth_mib)
    print(f"\nNVFP4 projection; memory bandwidth (numpy copy): {bandwidth / 1e9:.2f} GB/s")
    print(
        f"{'out x in':>11} {'batch':>5} "
        + " ".join(f"{p + ' ms':>9}" for p in PATHS)
        + " "
        + " ".join(f"{'fused/' + p:>22}" for p in OTHERS)
        + f" {'roofline ms ' + '/'.join(p[0] for p in PATHS):>24}  load"
    )
    rng = np.random.default_rng(5)
    cases = []
    for out_dim, in_dim in shapes or SHAPES:
        packed = nvfp4_random(rng, out_dim, in_dim)
        W = nvfp4_dequantize(*packed)
        arrays = {p: list(packed) for p in PATHS} | {"f32": [W]}
        models, inputs = load_paths(
            session,
            arrays,
            lambda path, o=out_dim, i=in_dim: build_graph(path, o, i),
            compile_s,
            f"nvfp4_{{}}_{out_dim}x{in_dim}",
        )
        for batch in batches:
            x = rng.standard_normal((batch, in_dim), dtype=np.float32)
            xb = Buffer.from_numpy(x)
            ref = x.astype(np.float64) @ W.T.astype(np.float64)
            timed = time_case(
                models,
                inputs,
                xb,
                ref,
                base="fused",
                others=OTHERS,
                repetitions=repetitions,
                inner=inner,
                what=f"nvfp4 {out_dim}x{in_dim} batch={batch}",
            )
            med, ratios, runs, load = timed.median_ms, timed.ratios, timed.runs, timed.load
            nbytes = {p: weight_bytes(p, out_dim, in_dim) for p in PATHS}
            roof = {p: nbytes[p] / bandwidth * 1e3 for p in PATHS}
            case = {
                "out": out_dim,
                "in": in_dim,
                "batch": batch,
                "median_ms": med,
                **{f"fused_over_{p}": r.to_json() for p, r in ratios.items()},
                "weight_bytes": nbytes,
                "weight_bytes_per_token": {p: b / batch for p, b in nbytes.items()},
                "roofline_ms": roof,
                "pairs": repetitions,
                "order": {f"vs_{p}": r.order_string() for p, r in runs.items()},
                "load": load.to_json(),
                "max_rel_error": timed.errors,
                "samples_s": timed.samples,
            }
            cases.append(case)
            shown = [
                f"{r.ratio:.3f} [{r.low:.3f}, {r.high:.3f}]".rjust(22) for r in ratios.values()
            ]
            roofs = "/".join(f"{roof[p]:.2f}" for p in PATHS)
            print(
                f"{out_dim:>5}x{in_dim:<5} {batch:>5} "
                + " ".join(f"{med[p]:>9.3f}" for p in PATHS)
                + " "
                + " ".join(shown)
                + f" {roofs:>24}  {load.describe()}"
            )
            on_case(case)
    return {
        "memory_bandwidth_bytes_per_s": bandwidth,
        "bandwidth_method": f"np.copyto of {bandwidth_mib} MiB, (read + written) / best time",
        "ratio": "fused/other latency (geometric mean of within-pair ratios, ABBA pairs, "
        "bootstrap over pairs 95% CI); < 1: the fused NVFP4 op faster",
        "cases": cases,
    }
