"""NVFP4 in :mod:`attnquant_kernels.testing`: packed weights in Model Optimizer's layout
(:func:`nvfp4_random`), their numpy dequantization (:func:`nvfp4_dequantize`), and the
``generated_linear_nvfp4`` graphs (row-major and tiled) with their checks."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ._graphs import (
    Device,
    OpModel,
    _bf16,
    _check_device,
    _f32,
    _graph_name,
    _min_rank,
    session_model,
)
from ._reference import BF16_RTOL, F32_RTOL, Report, apply, close, round_bf16, theta

__all__ = [
    "E2M1",
    "build_linear_nvfp4",
    "build_linear_nvfp4_tiled",
    "build_linear_nvfp4_tiled_a8",
    "check_linear_nvfp4",
    "check_linear_nvfp4_tiled",
    "check_linear_nvfp4_tiled_a8",
    "quantize_activations_a8",
    "nvfp4_dequantize",
    "nvfp4_random",
]


#: The value of each 4-bit E2M1 code (code 8 is -0).
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def nvfp4_dequantize(
    weight: np.ndarray, weight_scale: np.ndarray, weight_scale_2: np.ndarray | float
) -> np.ndarray:
    """``W [out, in]`` float32 from packed codes, E4M3 scale bytes (uint8) and the global scale.

    ``E2M1[code] * (float(scale) * scale_2)`` in float32, the reference's order; scale bytes
    0x7F / 0xFF are NaN (imports ``ml_dtypes``).
    """
    import ml_dtypes

    codes = np.stack([weight & 0x0F, weight >> 4], axis=-1).reshape(weight.shape[0], -1)
    scales = np.ascontiguousarray(weight_scale, np.uint8).view(ml_dtypes.float8_e4m3fn)
    step = scales.astype(np.float32) * np.float32(np.asarray(weight_scale_2).reshape(()))
    return E2M1[codes] * np.repeat(step, 16, axis=1)


def nvfp4_random(
    rng: np.random.Generator, out_dim: int, in_dim: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(weight, weight_scale, weight_scale_2)``: every code, scales from 1/4 to 4 (bytes
    0x28..0x48) and a global scale of ``1/sqrt(in)``, so outputs are of order one."""
    weight = rng.integers(0, 256, (out_dim, in_dim // 2), dtype=np.uint8)
    weight_scale = rng.integers(0x28, 0x49, (out_dim, in_dim // 16), dtype=np.uint8)
    weight_scale_2 = np.array([1.0 / np.sqrt(max(in_dim, 1))], np.float32)
    return weight, weight_scale, weight_scale_2


def _nvfp4_input_types(dev: Any) -> list[Any]:
    """The inputs of the NVFP4 op models: ``x [M, K]``, ``weight [N, KH]``, ``weight_scale
    [N, KB]``, ``weight_scale_2 [1]``, ``s [N]``, ``U [N, R]``, ``V [K, R]``."""
    from max.dtype import DType
    from max.graph import TensorType

    f32, u8 = DType.float32, DType.uint8
    shapes = (
        (f32, ["M", "K"]),
        (u8, ["N", "KH"]),
        (u8, ["N", "KB"]),
        (f32, [1]),
        (f32, ["N"]),
        (f32, ["N", "R"]),
        (f32, ["K", "R"]),
    )
    return [TensorType(dtype, shape, device=dev) for dtype, shape in shapes]


def _nvfp4_op_model(name: str, device: Device, outputs: Callable[..., Sequence[Any]]) -> OpModel:
    """The NVFP4 op models' one graph: inputs :func:`_nvfp4_input_types`, the outputs
    ``outputs(x, w, ws, ws2, s, U, V)`` builds from them, compiled on ``device``."""
    from max.graph import DeviceRef, Graph

    from .. import kernels_path

    dev = DeviceRef.GPU() if device == "gpu" else DeviceRef.CPU()
    types = _nvfp4_input_types(dev)
    with Graph(
        _graph_name(name, device), input_types=types, custom_extensions=[kernels_path()]
    ) as g:
        g.output(*outputs(*(v.tensor for v in g.inputs)))
    return session_model(g, device)


def build_linear_nvfp4(device: Device = "cpu") -> OpModel:
    """``generated_linear_nvfp4``, every dimension symbolic, compiled on ``device``.

    Inputs ``x [M, K]`` (float32), ``weight [N, KH]`` and ``weight_scale [N, KB]`` (uint8),
    ``weight_scale_2 [1]``, ``s [N]``, ``U [N, R]``, ``V [K, R]`` (float32); the kernel checks
    ``KH = K/2`` and ``KB = K/16``. Outputs: the op (float32); the plain NVFP4 projection
    (``s``, ``U``, ``V`` omitted: ``x @ W^T``); the op on bfloat16 ``x``, ``s``, ``U``, ``V``
    (cast back to float32); ``nvfp4_dequantize``'s float32 ``W [N, 2 KH]``, and its ``W^T``
    in bfloat16 (``transposed``, cast back to float32).
    """
    from max.dtype import DType

    from ..graph import generated_linear_nvfp4, nvfp4_dequantize

    _check_device(device)

    def outputs(x, w, ws, ws2, s, U, V):
        xb, sb, Ub, Vb = _bf16([x, s, U, V])
        return (
            generated_linear_nvfp4(x, w, ws, ws2, s, U, V),
            generated_linear_nvfp4(x, w, ws, ws2),
            _f32(generated_linear_nvfp4(xb, w, ws, ws2, sb, Ub, Vb)),
            nvfp4_dequantize(w, ws, ws2),
            _f32(nvfp4_dequantize(w, ws, ws2, DType.bfloat16, transposed=True)),
        )

    return _nvfp4_op_model("linear_nvfp4", device, outputs)


def check_linear_nvfp4(
    model: OpModel,
    M: int,
    K: int,
    N: int,
    R: int,
    seed: int = 0,
    *,
    report: Report | None = None,
) -> None:
    """One random case of :func:`build_linear_nvfp4`'s model against the float64 identity over
    the numpy-dequantized weight: ``s * (x W^T) + (x V) U^T``, and ``x W^T`` for the plain form;
    ``nvfp4_dequantize``'s ``W`` equals the numpy one bit for bit, its bfloat16 ``W^T`` the
    numpy one rounded to bfloat16.
    """
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((M, K)).astype(np.float32)
    packed = nvfp4_random(rng, N, K)
    W = nvfp4_dequantize(*packed)
    _, s, U, V = theta(rng, N, K, max(R, _min_rank(model)))
    y, y0, yb, W_op, Wt_bf16 = model(x, *packed, s, U, V)
    what = f"{model.device} linear_nvfp4 M={M} K={K} N={N}"
    for label, got, want in (("", W_op, W), (" bf16 transposed", Wt_bf16, round_bf16([W.T])[0])):
        if not np.array_equal(got, want):
            wrong = int(np.count_nonzero(got != want))
            raise AssertionError(f"{what}: nvfp4_dequantize{label} differs from numpy in {wrong}")
    _close_nvfp4((y, y0, yb), x, W, s, U, V, what, report=report)


def _close_nvfp4(
    outputs: Sequence[np.ndarray],
    x: np.ndarray,
    W: np.ndarray,
    s: np.ndarray,
    U: np.ndarray,
    V: np.ndarray,
    what: str,
    *,
    report: Report | None = None,
) -> None:
    """The op, its plain form and its bfloat16 form against the float64 identity over ``W``."""
    y, y0, yb = outputs
    r = U.shape[1]
    close(y, apply(x, W, s, U, V), F32_RTOL, f"{what} r={r}", report=report)
    plain = apply(x, W, np.ones(W.shape[0], np.float32), U[:, :0], V[:, :0])
    close(y0, plain, F32_RTOL, f"{what} plain (s=U=V=None)", report=report)
    xb, sb, Ub, Vb = round_bf16([x, s, U, V])
    close(yb, apply(xb, W, sb, Ub, Vb), BF16_RTOL, f"{what} r={r} bf16", report=report)


def build_linear_nvfp4_tiled() -> OpModel:
    """``generated_linear_nvfp4_tiled`` on the CPU, every dimension symbolic: inputs as
    :func:`build_linear_nvfp4`'s (``weight`` and ``weight_scale`` in the tiled layout of
    :func:`attnquant_kernels.layout.tile_nvfp4`); outputs the op (float32), the plain NVFP4
    projection, and the op on bfloat16 ``x``, ``s``, ``U``, ``V`` (cast back to float32)."""
    from ..graph import generated_linear_nvfp4

    def outputs(x, w, ws, ws2, s, U, V):
        xb, sb, Ub, Vb = _bf16([x, s, U, V])
        return (
            generated_linear_nvfp4(x, w, ws, ws2, s, U, V, tiled=True),
            generated_linear_nvfp4(x, w, ws, ws2, tiled=True),
            _f32(generated_linear_nvfp4(xb, w, ws, ws2, sb, Ub, Vb, tiled=True)),
        )

    return _nvfp4_op_model("linear_nvfp4_tiled", "cpu", outputs)


def check_linear_nvfp4_tiled(model: OpModel, M: int, K: int, N: int, R: int, seed: int = 0) -> None:
    """One random case of :func:`build_linear_nvfp4_tiled`'s model: the weight tiled in numpy,
    the outputs against the float64 identity over the row-major weight dequantized in numpy."""
    from ..layout import tile_nvfp4

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((M, K)).astype(np.float32)
    weight, weight_scale, weight_scale_2 = nvfp4_random(rng, N, K)
    W = nvfp4_dequantize(weight, weight_scale, weight_scale_2)
    _, s, U, V = theta(rng, N, K, R)
    outputs = model(x, *tile_nvfp4(weight, weight_scale), weight_scale_2, s, U, V)
    _close_nvfp4(outputs, x, W, s, U, V, f"cpu linear_nvfp4_tiled M={M} K={K} N={N}")


#: Inputs that share one int8 step in ``generated_linear_nvfp4_tiled_a8`` (4 blocks of 16).
A8_GROUP = 64
#: A group whose largest input is at most this share of its row's largest rounds to zeros.
A8_FLUSH = np.float32(2.0**-40)


def quantize_activations_a8(x: np.ndarray) -> np.ndarray:
    """``x [M, K]`` (float32) as ``generated_linear_nvfp4_tiled_a8`` rounds it, back in float64:
    per row and group of :data:`A8_GROUP` inputs (the last may be short, a multiple of 16)
    ``q = rint(x * (127 / amax))`` (ties to even, float32 arithmetic), times ``amax / 127``;
    a group whose ``amax`` is at most :data:`A8_FLUSH` times the row's is zeros."""
    x = np.asarray(x, np.float32)
    M, K = x.shape
    top = np.abs(x).max(axis=1, initial=np.float32(0)).astype(np.float32)
    out = np.zeros((M, K), np.float64)
    for start in range(0, K, A8_GROUP):
        group = x[:, start : start + A8_GROUP]
        amax = np.abs(group).max(axis=1, keepdims=True)
        kept = amax > top[:, None] * A8_FLUSH
        with np.errstate(divide="ignore"):
            inv = np.where(kept, np.float32(127) / amax, np.float32(0)).astype(np.float32)
        q = np.rint(group * inv)
        assert np.abs(q).max(initial=0) <= 127
        out[:, start : start + A8_GROUP] = q.astype(np.float64) * (amax.astype(np.float64) / 127)
    return out


def build_linear_nvfp4_tiled_a8() -> OpModel:
    """``generated_linear_nvfp4_tiled_a8`` on the CPU, every dimension symbolic, inputs as
    :func:`build_linear_nvfp4_tiled`'s; outputs the op and the plain projection (float32)."""
    from ..graph import generated_linear_nvfp4

    def outputs(x, w, ws, ws2, s, U, V):
        return (
            generated_linear_nvfp4(x, w, ws, ws2, s, U, V, tiled=True, activations="int8"),
            generated_linear_nvfp4(x, w, ws, ws2, tiled=True, activations="int8"),
        )

    return _nvfp4_op_model("linear_nvfp4_tiled_a8", "cpu", outputs)


def check_linear_nvfp4_tiled_a8(
    model: OpModel, M: int, K: int, N: int, R: int, seed: int = 0, *, x: np.ndarray | None = None
) -> None:
    """One random case of :func:`build_linear_nvfp4_tiled_a8`'s model against the float64
    identity: at any row count the outputs of whole tiles of 16 take ``x`` rounded as
    :func:`quantize_activations_a8` does; the correction ``(x V) U^T`` and the outputs past the
    last tile take float ``x``."""
    from ..layout import tile_nvfp4

    rng = np.random.default_rng(seed)
    if x is None:
        x = rng.standard_normal((M, K)).astype(np.float32)
    weight, weight_scale, weight_scale_2 = nvfp4_random(rng, N, K)
    W = nvfp4_dequantize(weight, weight_scale, weight_scale_2).astype(np.float64)
    _, s, U, V = theta(rng, N, K, R)
    y, y0 = model(x, *tile_nvfp4(weight, weight_scale), weight_scale_2, s, U, V)
    xq = quantize_activations_a8(x)
    tiles = N // 16 * 16
    plain = x.astype(np.float64) @ W.T
    plain[:, :tiles] = xq @ W[:tiles].T
    want = s.astype(np.float64) * plain + (x.astype(np.float64) @ V) @ U.T.astype(np.float64)
    what = f"cpu linear_nvfp4_tiled_a8 M={M} K={K} N={N}"
    close(y, want, F32_RTOL, f"{what} r={R}")
    close(y0, plain, F32_RTOL, f"{what} plain (s=U=V=None)")
