"""Helpers for testing the ops against numpy; needs numpy (and max for the graph builders), which
the package itself does not.

Not imported by :mod:`attnquant_kernels`: import it explicitly, from tests and benchmarks. Used by
the package's CPU op tests (``packages/attnquant-kernels/tests/test_ops.py``), the GPU checks
(``tests/test_gpu.py``) and ``benchmarks/bench_kernels.py``.

* References in float64: :func:`apply` (the identity ``s * (x @ W0.T) + (x @ V) @ U.T``),
  :func:`silu`, :func:`gelu_tanh`, :func:`mlp_ref`; :func:`theta` makes random float32
  ``(W0, s, U, V)``; :func:`round_bf16` rounds inputs through bfloat16 (needs ``ml_dtypes``).
* :func:`close` asserts an output against its reference, relative to the reference's largest
  entry (:func:`max_rel_error`).
* :func:`build_linear` / :func:`build_mlp` compile one graph per op with every dimension
  symbolic (batch, in, out, ranks), so one compile serves every shape and rank, on
  ``device="cpu"`` or ``"gpu"`` (inputs copied to the accelerator, outputs back to the host).
* :func:`check_linear` / :func:`check_mlp` run one random case through such a model and assert
  every output against the reference: float32 within :data:`F32_RTOL`, bfloat16 inputs within
  :data:`BF16_RTOL`.
* NVFP4 (``generated_linear_nvfp4``): :func:`nvfp4_random` makes packed weights in Model
  Optimizer's layout, :func:`nvfp4_dequantize` rebuilds the float weight in numpy (the same
  arithmetic as ``attnquant_max.dequantize_nvfp4``, which this package cannot import),
  :func:`build_linear_nvfp4` / :func:`check_linear_nvfp4` compile and check the op.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np

__all__ = [
    "BF16_RTOL",
    "F32_RTOL",
    "Device",
    "OpModel",
    "Report",
    "apply",
    "build_linear",
    "build_linear_nvfp4",
    "build_linear_nvfp4_tiled",
    "build_lowrank",
    "build_mlp",
    "check_linear",
    "check_linear_nvfp4",
    "check_linear_nvfp4_tiled",
    "check_lowrank",
    "check_mlp",
    "close",
    "gelu_tanh",
    "max_rel_error",
    "mlp_ref",
    "nvfp4_dequantize",
    "nvfp4_random",
    "rank0",
    "round_bf16",
    "session_model",
    "silu",
    "theta",
]

F32_RTOL = 1e-4  # the bar for float32
BF16_RTOL = 2e-2  # inputs and output rounded to bfloat16 (8-bit mantissa), float32 sums

Device = Literal["cpu", "gpu"]
#: Called by :func:`close` with (what, max relative error, bound) before it asserts.
Report = Callable[[str, float, float], None]


# ---------------------------------------------------------------- references (float64)


def theta(rng: np.random.Generator, out_dim: int, in_dim: int, rank: int) -> list[np.ndarray]:
    """(W0, s, U, V), float32, with outputs of order one."""
    W0 = rng.standard_normal((out_dim, in_dim)) / np.sqrt(max(in_dim, 1))
    s = 1.0 + 0.2 * rng.standard_normal(out_dim)
    U = 0.3 * rng.standard_normal((out_dim, rank))
    V = rng.standard_normal((in_dim, rank)) / np.sqrt(max(in_dim, 1))
    return [np.ascontiguousarray(a, dtype=np.float32) for a in (W0, s, U, V)]


def apply(x: np.ndarray, W0: np.ndarray, s: np.ndarray, U: np.ndarray, V: np.ndarray):
    """The identity of DESIGN §1 in float64: s * (x W0^T) + (x V) U^T."""
    f = [a.astype(np.float64) for a in (x, W0, s, U, V)]
    return f[2] * (f[0] @ f[1].T) + (f[0] @ f[4]) @ f[3].T


def silu(z: np.ndarray) -> np.ndarray:
    return z / (1.0 + np.exp(-z))


def gelu_tanh(z: np.ndarray) -> np.ndarray:
    return 0.5 * z * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (z + 0.044715 * z**3)))


def mlp_ref(x, gate, up, down, act) -> np.ndarray:
    """``down(act(gate(x)) * up(x))``, each projection a ``(W0, s, U, V)`` through :func:`apply`."""
    return apply(act(apply(x, *gate)) * apply(x, *up), *down)


def round_bf16(arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Each array rounded to bfloat16 and back to float32 (imports ``ml_dtypes``)."""
    import ml_dtypes

    return [a.astype(ml_dtypes.bfloat16).astype(np.float32) for a in arrays]


def rank0(proj: Sequence[np.ndarray]) -> list[np.ndarray]:
    """``(W0, s, U, V)`` with zero-size ``U [N, 0]``, ``V [K, 0]``: the rank-0 form."""
    W0, s, U, V = proj
    return [W0, s, U[:, :0], V[:, :0]]


def max_rel_error(got: np.ndarray, ref: np.ndarray) -> float:
    """``max |got - ref|`` relative to the reference's largest entry (0 for an empty or zero one)."""
    scale = float(np.abs(ref).max()) if ref.size else 1.0
    return float(np.abs(got - ref).max() / scale) if ref.size and scale else 0.0


def close(
    got: np.ndarray, ref: np.ndarray, rtol: float, what: str, *, report: Report | None = None
) -> None:
    """Within ``rtol`` of the reference, elementwise and relative to its largest entry.

    ``report``, when given, receives ``(what, max_rel_error, rtol)`` before the assertion.
    """
    assert got.shape == ref.shape, what
    assert np.isfinite(got).all(), f"{what}: non-finite output"
    scale = float(np.abs(ref).max()) if ref.size else 1.0
    if report is not None:
        report(what, max_rel_error(got, ref), rtol)
    np.testing.assert_allclose(got, ref, rtol=rtol, atol=rtol * scale, err_msg=what)


# ---------------------------------------------------------------- compiled graphs


class OpModel:
    """A compiled graph as a function: numpy arrays in, numpy arrays (on the host) out."""

    def __init__(self, run: Callable[..., list[np.ndarray]], device: Device) -> None:
        self._run = run
        #: ``"cpu"`` or ``"gpu"``: where the graph runs.
        self.device: Device = device

    def __call__(self, *arrays: np.ndarray) -> list[np.ndarray]:
        return self._run(*arrays)


def _check_device(device: str) -> None:
    if device not in ("cpu", "gpu"):
        raise ValueError(f"device must be 'cpu' or 'gpu', got {device!r}")


def session_model(graph: Any, device: Device = "cpu") -> OpModel:
    """``graph`` compiled in an ``InferenceSession`` on the CPU or the first accelerator.

    On the GPU the inputs are copied to the device and the outputs back to the host.
    """
    from max.driver import CPU, Accelerator, Buffer
    from max.engine import InferenceSession

    _check_device(device)
    host = CPU()
    target = Accelerator() if device == "gpu" else host
    model = InferenceSession(devices=[target]).load(graph)

    if device == "gpu":

        def run(*arrays: np.ndarray) -> list[np.ndarray]:
            inputs = [Buffer.from_numpy(np.ascontiguousarray(a)).to(target) for a in arrays]
            return [o.to(host).to_numpy() for o in model.execute(*inputs)]

    else:

        def run(*arrays: np.ndarray) -> list[np.ndarray]:
            inputs = [Buffer.from_numpy(np.ascontiguousarray(a)) for a in arrays]
            return [o.to_numpy() for o in model.execute(*inputs)]

    return OpModel(run, device)


def _bf16(values: Sequence[Any]) -> list[Any]:
    from max.dtype import DType
    from max.graph import ops

    return [ops.cast(v, DType.bfloat16) for v in values]


def _f32(value: Any) -> Any:
    from max.dtype import DType
    from max.graph import ops

    return ops.cast(value, DType.float32)


def _input_types(shapes: Sequence[Sequence[str]], device: Device) -> list[Any]:
    from max.dtype import DType
    from max.graph import DeviceRef, TensorType

    dev = DeviceRef.GPU() if device == "gpu" else DeviceRef.CPU()
    return [TensorType(DType.float32, list(s), device=dev) for s in shapes]


# The graphs' names are part of what MAX caches: "aq_<op>_test" on the CPU, "aq_<op>_gpu".
def _graph_name(op: str, device: Device) -> str:
    return f"aq_{op}_{'gpu' if device == 'gpu' else 'test'}"


def build_linear(device: Device = "cpu") -> OpModel:
    """``generated_linear``, every dimension symbolic, compiled on ``device``.

    Inputs ``x [M, K]``, ``W0 [N, K]``, ``s [N]``, ``U [N, R]``, ``V [K, R]`` (float32).
    Outputs: the op (float32), the rank-0 wrapper form (``U = V = None``), the op on bfloat16
    copies of its inputs (cast back to float32).
    """
    from max.graph import Graph

    from . import kernels_path
    from .graph import generated_linear

    _check_device(device)
    shapes = [["M", "K"], ["N", "K"], ["N"], ["N", "R"], ["K", "R"]]
    types = _input_types(shapes, device)
    name = _graph_name("linear", device)
    with Graph(name, input_types=types, custom_extensions=[kernels_path()]) as g:
        x, W0, s, U, V = (v.tensor for v in g.inputs)
        g.output(
            generated_linear(x, W0, s, U, V),
            generated_linear(x, W0, s),
            _f32(generated_linear(*_bf16([x, W0, s, U, V]))),
        )
    return session_model(g, device)


def build_lowrank(device: Device = "cpu") -> OpModel:
    """``generated_lowrank``, every dimension symbolic, compiled on ``device``.

    Inputs ``x [M, K]``, ``U [N, R]``, ``V [K, R]`` (float32). Outputs: the op (float32), the
    op on bfloat16 copies of its inputs (cast back to float32).
    """
    from max.graph import Graph

    from . import kernels_path
    from .graph import generated_lowrank

    _check_device(device)
    types = _input_types([["M", "K"], ["N", "R"], ["K", "R"]], device)
    name = _graph_name("lowrank", device)
    with Graph(name, input_types=types, custom_extensions=[kernels_path()]) as g:
        x, U, V = (v.tensor for v in g.inputs)
        g.output(generated_lowrank(x, U, V), _f32(generated_lowrank(*_bf16([x, U, V]))))
    return session_model(g, device)


def build_mlp(device: Device = "cpu", *, rank0_form: bool | None = None) -> OpModel:
    """``generated_mlp``, every dimension symbolic, compiled on ``device``.

    Inputs ``x [M, H]``, then ``(W0, s, U, V)`` of gate ``[F, H]``, up ``[F, H]``, down
    ``[H, F]`` (ranks ``RG``, ``RU``, ``RD``; float32). Outputs: SiLU, tanh-GELU (float32),
    with ``rank0_form`` SiLU in the rank-0 wrapper form (all three ``U = V = None``), then SiLU
    on bfloat16 copies of the inputs (cast back to float32). ``rank0_form`` defaults to
    ``device == "gpu"``, where a zero-size rank-0 buffer cannot be copied to the device.
    """
    from max.graph import Graph

    from . import kernels_path
    from .graph import generated_mlp

    _check_device(device)
    if rank0_form is None:
        rank0_form = device == "gpu"
    shapes = [["M", "H"]]
    for out_dim, in_dim, r in (("F", "H", "RG"), ("F", "H", "RU"), ("H", "F", "RD")):
        shapes += [[out_dim, in_dim], [out_dim], [out_dim, r], [in_dim, r]]
    types = _input_types(shapes, device)
    name = _graph_name("mlp", device)
    with Graph(name, input_types=types, custom_extensions=[kernels_path()]) as g:
        x, *w = (v.tensor for v in g.inputs)
        gate, up, down = w[0:4], w[4:8], w[8:12]
        rank0_projs = [(p[0], p[1], None, None) for p in (gate, up, down)]
        xb, *wb = _bf16([x, *w])
        outs = [
            generated_mlp(x, gate, up, down, activation="silu"),
            generated_mlp(x, gate, up, down, activation="gelu_tanh"),
        ]
        if rank0_form:
            outs.append(generated_mlp(x, *rank0_projs, activation="silu"))
        outs.append(_f32(generated_mlp(xb, wb[0:4], wb[4:8], wb[8:12], activation="silu")))
        g.output(*outs)
    return session_model(g, device)


# ---------------------------------------------------------------- checks


def _min_rank(model: OpModel) -> int:
    # On the GPU rank 0 goes through the rank-0 form only: no zero-byte buffer is copied there.
    return 1 if model.device == "gpu" else 0


def check_linear(
    model: OpModel,
    M: int,
    K: int,
    N: int,
    R: int,
    seed: int = 0,
    *,
    report: Report | None = None,
) -> None:
    """One random case of :func:`build_linear`'s model against the float64 identity.

    On the GPU a rank ``R`` of 0 runs the general output at r=1 (rank 0 is the rank-0 form's).
    """
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((M, K)).astype(np.float32)
    W0, s, U, V = theta(rng, N, K, max(R, _min_rank(model)))
    y, y0, yb = model(x, W0, s, U, V)
    r = U.shape[1]
    what = f"{model.device} linear M={M} K={K} N={N}"
    close(y, apply(x, W0, s, U, V), F32_RTOL, f"{what} r={r}", report=report)
    close(y0, apply(x, *rank0([W0, s, U, V])), F32_RTOL, f"{what} r=0 (U=V=None)", report=report)
    yb_ref = apply(*round_bf16([x, W0, s, U, V]))
    close(yb, yb_ref, BF16_RTOL, f"{what} r={r} bf16", report=report)


def check_lowrank(
    model: OpModel,
    M: int,
    K: int,
    N: int,
    R: int,
    seed: int = 0,
    *,
    report: Report | None = None,
) -> None:
    """One random case of :func:`build_lowrank`'s model against the float64 ``(x V) U^T``."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((M, K)).astype(np.float32)
    _, _, U, V = theta(rng, N, K, R)
    y, yb = model(x, U, V)
    what = f"{model.device} lowrank M={M} K={K} N={N} r={R}"
    ones = np.ones(N, np.float32)
    zero = np.zeros((N, K), np.float32)
    close(y, apply(x, zero, ones, U, V), F32_RTOL, what, report=report)
    xb, Ub, Vb = round_bf16([x, U, V])
    close(yb, apply(xb, zero, ones, Ub, Vb), BF16_RTOL, f"{what} bf16", report=report)


def check_mlp(
    model: OpModel,
    M: int,
    H: int,
    F: int,
    ranks: tuple[int, int, int],
    seed: int = 0,
    *,
    report: Report | None = None,
) -> None:
    """One random case of :func:`build_mlp`'s model against SiLU and tanh-GELU references.

    The rank-0 form, when the model computes it, against all three projections at r=0; on the
    GPU a rank of 0 runs the general outputs at r=1.
    """
    rng = np.random.default_rng(seed)
    lo = _min_rank(model)
    x = rng.standard_normal((M, H)).astype(np.float32)
    gate = theta(rng, F, H, max(ranks[0], lo))
    up = theta(rng, F, H, max(ranks[1], lo))
    down = theta(rng, H, F, max(ranks[2], lo))
    silu_y, gelu_y, *silu0, silu_bf16 = model(x, *gate, *up, *down)
    r = tuple(p[2].shape[1] for p in (gate, up, down))
    what = f"{model.device} mlp M={M} H={H} F={F}"
    close(silu_y, mlp_ref(x, gate, up, down, silu), F32_RTOL, f"{what} r={r} silu", report=report)
    gelu_ref = mlp_ref(x, gate, up, down, gelu_tanh)
    close(gelu_y, gelu_ref, F32_RTOL, f"{what} r={r} gelu_tanh", report=report)
    if silu0:
        ref0 = mlp_ref(x, rank0(gate), rank0(up), rank0(down), silu)
        close(silu0[0], ref0, F32_RTOL, f"{what} r=0 (U=V=None) silu", report=report)
    xb, *wb = round_bf16([x, *gate, *up, *down])
    ref_bf16 = mlp_ref(xb, wb[0:4], wb[4:8], wb[8:12], silu)
    close(silu_bf16, ref_bf16, BF16_RTOL, f"{what} r={r} silu bf16", report=report)


# ---------------------------------------------------------------- NVFP4

#: The value of each 4-bit E2M1 code (code 8 is -0).
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def nvfp4_dequantize(weight: np.ndarray, weight_scale: np.ndarray, weight_scale_2) -> np.ndarray:
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
    from max.graph import DeviceRef, Graph

    from . import kernels_path
    from .graph import generated_linear_nvfp4, nvfp4_dequantize

    _check_device(device)
    dev = DeviceRef.GPU() if device == "gpu" else DeviceRef.CPU()
    types = _nvfp4_input_types(dev)
    name = _graph_name("linear_nvfp4", device)
    with Graph(name, input_types=types, custom_extensions=[kernels_path()]) as g:
        x, w, ws, ws2, s, U, V = (v.tensor for v in g.inputs)
        xb, sb, Ub, Vb = _bf16([x, s, U, V])
        g.output(
            generated_linear_nvfp4(x, w, ws, ws2, s, U, V),
            generated_linear_nvfp4(x, w, ws, ws2),
            _f32(generated_linear_nvfp4(xb, w, ws, ws2, sb, Ub, Vb)),
            nvfp4_dequantize(w, ws, ws2),
            _f32(nvfp4_dequantize(w, ws, ws2, DType.bfloat16, transposed=True)),
        )
    return session_model(g, device)


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
    from max.graph import DeviceRef, Graph

    from . import kernels_path
    from .graph import generated_linear_nvfp4

    types = _nvfp4_input_types(DeviceRef.CPU())
    with Graph(
        _graph_name("linear_nvfp4_tiled", "cpu"),
        input_types=types,
        custom_extensions=[kernels_path()],
    ) as g:
        x, w, ws, ws2, s, U, V = (v.tensor for v in g.inputs)
        xb, sb, Ub, Vb = _bf16([x, s, U, V])
        g.output(
            generated_linear_nvfp4(x, w, ws, ws2, s, U, V, tiled=True),
            generated_linear_nvfp4(x, w, ws, ws2, tiled=True),
            _f32(generated_linear_nvfp4(xb, w, ws, ws2, sb, Ub, Vb, tiled=True)),
        )
    return session_model(g, "cpu")


def check_linear_nvfp4_tiled(model: OpModel, M: int, K: int, N: int, R: int, seed: int = 0) -> None:
    """One random case of :func:`build_linear_nvfp4_tiled`'s model: the weight tiled in numpy,
    the outputs against the float64 identity over the row-major weight dequantized in numpy."""
    from .layout import tile_nvfp4

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((M, K)).astype(np.float32)
    weight, weight_scale, weight_scale_2 = nvfp4_random(rng, N, K)
    W = nvfp4_dequantize(weight, weight_scale, weight_scale_2)
    _, s, U, V = theta(rng, N, K, R)
    outputs = model(x, *tile_nvfp4(weight, weight_scale), weight_scale_2, s, U, V)
    _close_nvfp4(outputs, x, W, s, U, V, f"cpu linear_nvfp4_tiled M={M} K={K} N={N}")
