"""NVFP4 in the graph, below the layers of :mod:`attnquant_max._nvfp4_layers`: the decoding
tables, :func:`dequantize_in_graph` and :func:`gather_nvfp4_rows` (an embedding lookup over
packed rows, row-major or tiled), the shapes of the three packed weights
(:func:`packed_specs`), the row helpers the layers branch and fold with (:func:`by_rows`,
:func:`on_rows`), and the start-up measurement of the fused op against the dequantized form
(:func:`measure_nvfp4`, on the layout :func:`nvfp4_tiled` picks).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
from max.dtype import DType
from max.graph import DeviceRef, StaticDim, TensorType, TensorValue, Weight, ops

from attnquant_core.forms import BLOCK_SIZE, E2M1_VALUES, E4M3_VALUES, check_nvfp4_shape
from attnquant_kernels.graph import generated_linear_nvfp4
from attnquant_kernels.layout import TILE_ROWS, cpu_prefers_tiled, tile_nvfp4

__all__ = [
    "DENSE_FROM_ROWS",
    "E2M1_PAIR_TABLE",
    "NVFP4Band",
    "by_rows",
    "dequantize_in_graph",
    "gather_nvfp4_rows",
    "measure_nvfp4",
    "nvfp4_tiled",
    "on_rows",
    "packed_specs",
]

#: ``E2M1_PAIR_TABLE[b] = (E2M1[b & 15], E2M1[b >> 4])``: both values a packed byte holds.
E2M1_PAIR_TABLE = np.stack(
    [E2M1_VALUES[np.arange(256) & 0x0F], E2M1_VALUES[np.arange(256) >> 4]], axis=1
).astype(np.float32)

# float8_e4m3fn bytes 0x7F and 0xFF are NaN; a quantizer never writes them (scales are finite
# and non-negative), so the table maps them to NaN too and a corrupt byte shows up as NaN.
_E4M3_TABLE = E4M3_VALUES.astype(np.float32)

#: One NVFP4 weight held elsewhere: ``(packed codes, E4M3 scale bytes, per-tensor scale)``.
NVFP4Band = tuple[Weight, Weight, Weight]

#: Rows (tokens of one forward) from which a fused NVFP4 projection on an accelerator writes its
#: float weight once and runs the stock matmul instead of the fused op (the crossover of the
#: op's register tiles on this project's CPU, before its panel GEMM; see the module docstring).
DENSE_FROM_ROWS = 64


def by_rows(
    x: TensorValue,
    out_dim: int,
    small: Callable[[], TensorValue],
    large: Callable[[], TensorValue],
    from_rows: int = DENSE_FROM_ROWS,
) -> TensorValue:
    """``small()`` when ``x [M, in]`` has fewer than ``from_rows`` rows, else
    ``large()``: one ``ops.cond`` on ``M`` at run time, both ``[M, out_dim]`` of ``x``'s dtype
    (a static ``M`` picks its branch when the graph is built).

    The branches must only use graph values made before the call (weights are placed at the
    top of the graph, so they are safe to name inside either), and must share no op: MAX 26.7
    merges an op that both branches compute into one that neither dominates, and the graph then
    fails to compile ("operand does not dominate this use").
    """
    if isinstance(x.shape[0], StaticDim):
        return small() if int(x.shape[0]) < from_rows else large()
    rows = ops.shape_to_tensor([x.shape[0]])  # int64 [1], on the host
    pred = ops.reshape(rows >= from_rows, [])
    out = TensorType(x.dtype, [x.shape[0], out_dim], device=x.device)
    (y,) = ops.cond(pred, [out], large, small)
    return y


def on_rows(
    x: TensorValue, in_dim: int, out_dim: int, fn: Callable[[TensorValue], TensorValue]
) -> TensorValue:
    """``fn`` of ``x`` with its leading dimensions folded into rows (``[M, in_dim]`` in,
    ``[M, out_dim]`` out), unfolded again after."""
    if x.rank == 2:
        return fn(x)
    lead = list(x.shape[:-1])
    return ops.reshape(fn(ops.reshape(x, [-1, in_dim])), [*lead, out_dim])


def packed_specs(out_dim: int, in_dim: int) -> tuple[tuple[DType, list[int]], ...]:
    """dtype and shape of the three weights holding an NVFP4 ``[out_dim, in_dim]`` weight, in
    :data:`attnquant_core.io.NVFP4_PARTS` order: the packed codes, the E4M3 block scales as
    bytes, the per-tensor scale."""
    return (
        (DType.uint8, [out_dim, in_dim // 2]),
        (DType.uint8, [out_dim, in_dim // BLOCK_SIZE]),
        (DType.float32, [1]),
    )


def dequantize_in_graph(
    weight: TensorValue, weight_scale: TensorValue, weight_scale_2: TensorValue, dtype: DType
) -> TensorValue:
    """``W [out, in]`` of ``dtype`` from packed codes, E4M3 scale bytes and the per-tensor scale
    (row-major; ``out`` static or not, so gathered rows decode the same way).

    Float32 arithmetic in the reference's order: ``E2M1[code] * (scale * scale_2)``.
    """
    device = weight.device
    in_dim = 2 * int(weight.shape[1])
    rows = weight.shape[0]
    pairs = ops.constant(E2M1_PAIR_TABLE, DType.float32, device=device)
    values = ops.gather(pairs, ops.cast(weight, DType.int32), axis=0)  # [M, in/2, 2]
    values = ops.reshape(values, [rows, in_dim // BLOCK_SIZE, BLOCK_SIZE])
    table = ops.constant(_E4M3_TABLE, DType.float32, device=device)
    scales = ops.gather(table, ops.cast(weight_scale, DType.int32), axis=0)  # [M, in/16]
    step = scales * ops.reshape(weight_scale_2, [])
    W = ops.reshape(values * ops.unsqueeze(step, -1), [rows, in_dim])
    return ops.cast(W, dtype) if dtype != DType.float32 else W


def _unit_index(rows: TensorValue, num_rows: int, units: int, *, tiled: bool) -> TensorValue:
    """``[M, units]``: where unit ``u`` of each row of ``rows [M]`` (int64) sits in a weight of
    ``num_rows`` rows held as ``num_rows * units`` equal units (the layout of
    :func:`attnquant_kernels.layout.tile_nvfp4`: in a tile of 16 rows, unit ``u`` of the 16 rows
    side by side; the rows past the last whole tile, and a row-major weight, row after row)."""
    r = ops.unsqueeze(rows, -1)  # [M, 1]
    u = ops.constant(np.arange(units, dtype=np.int64), DType.int64, device=rows.device)
    row_major = r * units + u
    whole = (num_rows // TILE_ROWS) * TILE_ROWS
    if not tiled or whole == 0:
        return row_major
    in_tile = ((r // TILE_ROWS) * units + u) * TILE_ROWS + r % TILE_ROWS
    return in_tile if whole == num_rows else ops.where(r < whole, in_tile, row_major)


def gather_nvfp4_rows(
    weight: TensorValue,
    weight_scale: TensorValue,
    weight_scale_2: TensorValue,
    ids: TensorValue,
    dtype: DType,
    *,
    tiled: bool = False,
) -> TensorValue:
    """Rows ``ids`` of an NVFP4 ``W [N, K]``, decoded: ``[*ids.shape, K]`` of ``dtype``.

    An embedding lookup over a table held at 4.5 bits a weight: only the packed bytes and scales
    of the rows asked for are gathered (one 32-bit word of codes per 8 inputs, one scale byte per
    16), then decoded as :func:`dequantize_in_graph` decodes a whole weight, so row ``i`` is
    exactly row ``i`` of :func:`attnquant_core.forms.dequantize_nvfp4`. ``tiled``: the weight and
    scales hold the tiled layout of :func:`attnquant_kernels.layout.tile_nvfp4` (a tied head's
    bytes, read where the fused op reads them).
    """
    num_rows, half = (int(d) for d in weight.shape)
    in_dim = 2 * half
    flat = ops.reshape(ops.cast(ids, DType.int64), [-1])
    words, blocks = in_dim // 8, in_dim // BLOCK_SIZE
    packed = ops.gather(
        ops.reshape(weight, [num_rows * words, 4]),
        _unit_index(flat, num_rows, words, tiled=tiled),
        axis=0,
    )  # [M, K/8, 4]
    scales = ops.gather(
        ops.reshape(weight_scale, [num_rows * blocks]),
        _unit_index(flat, num_rows, blocks, tiled=tiled),
        axis=0,
    )  # [M, K/16]
    rows = dequantize_in_graph(ops.reshape(packed, [-1, half]), scales, weight_scale_2, dtype)
    return rows if ids.rank == 1 else ops.reshape(rows, [*ids.shape, in_dim])


def nvfp4_tiled(device: DeviceRef) -> bool:
    """Whether fused NVFP4 projections on ``device`` read the tiled layout: on a CPU whose lane
    tiles run it faster (:func:`attnquant_kernels.layout.cpu_prefers_tiled`: AVX-512)."""
    return device.device_type.value == "cpu" and cpu_prefers_tiled()


def measure_nvfp4(
    device: DeviceRef, out_dim: int, in_dim: int, *, runs: int = 5
) -> dict[str, float]:
    """Seconds of one batch-1 execution of an ``[out, in]`` NVFP4 projection, best of ``runs``:
    ``"fused"`` (``generated_linear_nvfp4``, on the tiled layout where :func:`nvfp4_tiled`)
    and ``"dequantize"`` (in the graph, then matmul), and ``"max_rel_difference"`` between
    their outputs (relative to the largest entry).

    Compiles two small graphs (cached by MAX after the first time); random packed weights.
    """
    from max.driver import CPU, Accelerator, Buffer
    from max.engine import InferenceSession
    from max.graph import Graph, TensorType

    from attnquant_kernels import kernels_path

    check_nvfp4_shape((out_dim, in_dim))
    on_gpu = device.device_type.value != "cpu"
    target = Accelerator(id=device.id) if on_gpu else CPU()
    session = InferenceSession(devices=[target])
    rng = np.random.default_rng(0)
    arrays = [
        rng.standard_normal((1, in_dim), dtype=np.float32),
        rng.integers(0, 256, (out_dim, in_dim // 2), dtype=np.uint8),
        np.full((out_dim, in_dim // BLOCK_SIZE), 0x38, np.uint8),  # E4M3 1.0
        np.full(1, 1 / np.sqrt(in_dim), np.float32),
    ]
    types = [
        TensorType(DType.float32, ["batch", in_dim], device=device),
        TensorType(DType.uint8, [out_dim, in_dim // 2], device=device),
        TensorType(DType.uint8, [out_dim, in_dim // BLOCK_SIZE], device=device),
        TensorType(DType.float32, [1], device=device),
    ]
    tiled = nvfp4_tiled(device)

    def buffers(values: list[np.ndarray]) -> list[Any]:
        return [Buffer.from_numpy(a).to(target) if on_gpu else Buffer.from_numpy(a) for a in values]

    seconds: dict[str, float] = {}
    outputs: dict[str, np.ndarray] = {}
    for name in ("fused", "dequantize"):
        values, label = arrays, name
        if name == "fused" and tiled:  # the same weight, in the layout the tiled op reads
            values = [arrays[0], *tile_nvfp4(arrays[1], arrays[2]), arrays[3]]
            label = "fused_tiled"
        inputs = buffers(values)
        graph_name = f"aq_nvfp4_{label}_{out_dim}x{in_dim}"
        with Graph(graph_name, input_types=types, custom_extensions=[kernels_path()]) as g:
            x, w, ws, ws2 = (v.tensor for v in g.inputs)
            if name == "fused":
                g.output(generated_linear_nvfp4(x, w, ws, ws2, tiled=tiled))
            else:
                g.output(x @ dequantize_in_graph(w, ws, ws2, DType.float32).T)
        model = session.load(g)
        (out,) = model.execute(*inputs)  # warm-up, and the result to compare
        outputs[name] = out.to(CPU()).to_numpy() if on_gpu else out.to_numpy()
        best = float("inf")
        for _ in range(runs):
            t0 = time.perf_counter()
            model.execute(*inputs)
            if on_gpu:
                target.synchronize()
            best = min(best, time.perf_counter() - t0)
        seconds[name] = best
    ref = outputs["dequantize"]
    scale = float(np.abs(ref).max()) or 1.0
    seconds["max_rel_difference"] = float(np.abs(outputs["fused"] - ref).max()) / scale
    return seconds
