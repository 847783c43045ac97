"""The low-rank section of ``bench_kernels.py``: one projection in a form without ``W0``.

``W = U V^T`` at a stored-bytes ratio ``--lowrank-ratio`` (default 0.5: ``r (out + in) = 0.5 out
in``, the rank a ``--budget 0.5`` fit gives a layer when it spreads the bytes evenly), for the
shapes of the 300M benchmark model: 1024x1024 (q/o), 4096x1024 (gate/up), 1024x4096 (down);
float32; the weights are graph inputs, every weight dimension static and the batch symbolic.

* ``op``: ``generated_lowrank`` (attnquant-kernels), the custom-op path (``ATTNQUANT_GEMM=0``):
  ``t = x V`` and ``t U^T`` in one dispatch.
* ``gemm``: the GEMM path's two stock matmuls (``FactoredLinear``): ``(x @ V) @ U^T``.
* ``f32``: the stock float32 matmul over the dense ``W``: twice the bytes at 0.5.

``op`` is paired (ABBA) with each of the others, ratios < 1: the op faster; every path checked
against the float64 ``(x V) U^T`` to 1e-4 first; the roofline of a path is its weight bytes over
the memory bandwidth of a numpy copy, as in the NVFP4 section. CPU only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from kernels_nvfp4 import load_paths, memory_bandwidth, time_case

#: ``(out, in)`` of the projections timed.
SHAPES: tuple[tuple[int, int], ...] = ((1024, 1024), (4096, 1024), (1024, 4096))
PATHS = ("op", "gemm", "f32")
OTHERS = PATHS[1:]


def rank_for(out_dim: int, in_dim: int, ratio: float) -> int:
    """The rank whose factors hold ``ratio`` of the dense weight's bytes."""
    return max(1, int(ratio * out_dim * in_dim / (out_dim + in_dim)))


def build_graph(path: str, out_dim: int, in_dim: int, rank: int):
    """One projection on ``path`` for ``x [batch, in]`` (float32), on the CPU."""
    from max.dtype import DType
    from max.graph import DeviceRef, Graph, TensorType

    from attnquant_kernels import kernels_path

    dev = DeviceRef.CPU()
    x_type = TensorType(DType.float32, ["batch", in_dim], device=dev)
    name = f"lowrank_{path}_{out_dim}x{in_dim}_r{rank}"
    if path == "f32":
        types = [x_type, TensorType(DType.float32, [out_dim, in_dim], device=dev)]
        with Graph(name, input_types=types) as g:
            x, W = (v.tensor for v in g.inputs)
            g.output(x @ W.T)
        return g
    types = [
        x_type,
        TensorType(DType.float32, [out_dim, rank], device=dev),
        TensorType(DType.float32, [in_dim, rank], device=dev),
    ]
    with Graph(name, input_types=types, custom_extensions=[kernels_path()]) as g:
        x, U, V = (v.tensor for v in g.inputs)
        if path == "op":
            from attnquant_kernels.graph import generated_lowrank

            g.output(generated_lowrank(x, U, V))
        else:
            g.output((x @ V) @ U.T)
    return g


def run_section(
    session: Any,
    *,
    batches: list[int],
    repetitions: int,
    inner: int,
    bandwidth_mib: int,
    ratio: float,
    compile_s: dict[str, float],
    on_case: Callable[[dict], None],
    shapes: Sequence[tuple[int, int]] | None = None,
) -> dict:
    """Time every shape (default :data:`SHAPES`) and batch; ``on_case`` gets each case."""
    from max.driver import Buffer

    bandwidth = memory_bandwidth(bandwidth_mib)
    print(
        f"\nLow-rank projection at {ratio} of the dense bytes; memory bandwidth (numpy copy): "
        f"{bandwidth / 1e9:.2f} GB/s"
    )
    print(
        f"{'out x in':>11} {'r':>4} {'batch':>5} "
        + " ".join(f"{p + ' ms':>9}" for p in PATHS)
        + " "
        + " ".join(f"{'op/' + p:>22}" for p in OTHERS)
        + f" {'roofline ms op/f32':>19}  load"
    )
    rng = np.random.default_rng(7)
    cases = []
    for out_dim, in_dim in shapes or SHAPES:
        rank = rank_for(out_dim, in_dim, ratio)
        U = (rng.standard_normal((out_dim, rank)) / np.sqrt(rank)).astype(np.float32)
        V = (rng.standard_normal((in_dim, rank)) / np.sqrt(in_dim)).astype(np.float32)
        W = (U.astype(np.float64) @ V.T.astype(np.float64)).astype(np.float32)
        arrays = {"op": [U, V], "gemm": [U, V], "f32": [W]}
        models, inputs = load_paths(
            session,
            arrays,
            lambda path, o=out_dim, i=in_dim, r=rank: build_graph(path, o, i, r),
            compile_s,
            f"lowrank_{{}}_{out_dim}x{in_dim}",
        )
        nbytes = {"op": U.nbytes + V.nbytes, "gemm": U.nbytes + V.nbytes, "f32": W.nbytes}
        roof = {p: nbytes[p] / bandwidth * 1e3 for p in PATHS}
        for batch in batches:
            x = rng.standard_normal((batch, in_dim), dtype=np.float32)
            ref = (x.astype(np.float64) @ V.astype(np.float64)) @ U.T.astype(np.float64)
            timed = time_case(
                models,
                inputs,
                Buffer.from_numpy(x),
                ref,
                base="op",
                others=OTHERS,
                repetitions=repetitions,
                inner=inner,
                what=f"lowrank {out_dim}x{in_dim} r={rank} batch={batch}",
            )
            case = {
                "out": out_dim,
                "in": in_dim,
                "rank": rank,
                "batch": batch,
                "median_ms": timed.median_ms,
                **{f"op_over_{p}": r.to_json() for p, r in timed.ratios.items()},
                "weight_bytes": nbytes,
                "roofline_ms": roof,
                "pairs": repetitions,
                "order": {f"vs_{p}": r.order_string() for p, r in timed.runs.items()},
                "load": timed.load.to_json(),
                "max_rel_error": timed.errors,
                "samples_s": timed.samples,
            }
            cases.append(case)
            shown = [
                f"{r.ratio:.3f} [{r.low:.3f}, {r.high:.3f}]".rjust(22)
                for r in timed.ratios.values()
            ]
            print(
                f"{out_dim:>5}x{in_dim:<5} {rank:>4} {batch:>5} "
                + " ".join(f"{timed.median_ms[p]:>9.3f}" for p in PATHS)
                + " "
                + " ".join(shown)
                + f" {roof['op']:>9.2f}/{roof['f32']:<9.2f}  {timed.load.describe()}"
            )
            on_case(case)
    return {
        "memory_bandwidth_bytes_per_s": bandwidth,
        "stored_bytes_ratio": ratio,
        "ratio": "op/other latency (geometric mean of within-pair ratios, ABBA pairs, "
        "bootstrap over pairs 95% CI); < 1: generated_lowrank faster",
        "cases": cases,
    }
