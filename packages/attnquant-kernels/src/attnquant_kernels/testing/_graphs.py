"""The compiled op graphs of :mod:`attnquant_kernels.testing` (``generated_linear``,
``generated_lowrank``, ``generated_mlp``, every dimension symbolic) and the checks that run one
random case through each against :mod:`._reference`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np

from ._reference import (
    BF16_RTOL,
    F32_RTOL,
    Report,
    apply,
    close,
    gelu_tanh,
    mlp_ref,
    rank0,
    round_bf16,
    silu,
    theta,
)

__all__ = [
    "Device",
    "OpModel",
    "build_linear",
    "build_lowrank",
    "build_mlp",
    "check_linear",
    "check_lowrank",
    "check_mlp",
    "session_model",
]

Device = Literal["cpu", "gpu"]


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

    from .. import kernels_path
    from ..graph import generated_linear

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

    from .. import kernels_path
    from ..graph import generated_lowrank

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

    from .. import kernels_path
    from ..graph import generated_mlp

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
