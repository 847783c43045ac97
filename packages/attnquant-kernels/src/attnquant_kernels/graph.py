"""The custom ops as MAX graph calls: the one module of the package that imports ``max``.

Inside a graph that loads the kernels (``Graph(..., custom_extensions=[kernels_path()])``,
or any graph created under ``max.graph.default_custom_extensions_scope(kernels_path())``)::

    y = generated_linear(x, W0, s, U, V)                      # [M, N], dtype of x
    y = generated_lowrank(x, U, V)                            # [M, N]: (x @ V) @ U^T
    y = generated_mlp(x, (W0_g, s_g, U_g, V_g), (W0_u, s_u, U_u, V_u),
                      (W0_d, s_d, U_d, V_d), activation="silu")  # [M, H]
    y = generated_linear_nvfp4(x, weight, weight_scale, weight_scale_2, s, U, V)  # [M, N]
    W = nvfp4_dequantize(weight, weight_scale, weight_scale_2)                # [N, K] float32

``x`` is ``[M, K]`` (fold leading dimensions into ``M`` first); every tensor has the dtype of
``x`` (float32 or bfloat16) and lives on its device. Rank 0: pass ``U = V = None`` and the
wrapper feeds zero-size ``[N, 0]`` / ``[K, 0]`` tensors. A static rank above
:data:`~attnquant_kernels.MAX_RANK` raises :class:`~attnquant_kernels.RankError` here, before
any compilation; a symbolic rank is checked by the kernel at run time (same message).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from max.dtype import DType
from max.graph import Dim, StaticDim, TensorType, TensorValue, TensorValueLike, ops

from ._locate import check_rank, kernels_path

__all__ = [
    "ACTIVATIONS",
    "generated_linear",
    "generated_linear_nvfp4",
    "generated_lowrank",
    "generated_mlp",
    "nvfp4_dequantize",
]

#: Activation names accepted by :func:`generated_mlp`, and the kernel parameter each maps to
#: (Hugging Face ``hidden_act`` spellings included).
ACTIVATIONS: dict[str, str] = {
    "silu": "silu",
    "swish": "silu",
    "gelu_tanh": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
}

_FLOAT = (DType.float32, DType.bfloat16, DType.float16)


def _value(t: TensorValueLike | None) -> TensorValue | None:
    """A graph value (a ``Weight`` becomes its value in the current graph)."""
    return None if t is None else TensorValue(t)


def _static(dim: Dim) -> int | None:
    return int(dim) if isinstance(dim, StaticDim) else None


def _rank_of(U: TensorValue, op: str, what: str = "") -> None:
    rank = _static(U.shape[1])
    if rank is not None:
        check_rank(rank, op=op, what=what)


def _operands(
    x: TensorValue,
    W0: TensorValueLike,
    s: TensorValueLike,
    U: TensorValueLike | None,
    V: TensorValueLike | None,
    *,
    op: str,
    what: str,
    in_dim: Dim,
    w0_dtype: bool = True,
) -> list[TensorValue]:
    """``[W0, s, U, V]`` checked against ``x``; zero-size ``U``/``V`` for rank 0.

    ``w0_dtype=False``: ``W0`` is packed (NVFP4) and checked by the caller, not here.
    """
    W0, s, U, V = TensorValue(W0), TensorValue(s), _value(U), _value(V)
    name = f"{op} ({what})" if what else op
    for label, t in (("W0", W0), ("s", s), ("U", U), ("V", V)):
        if t is None or (label == "W0" and not w0_dtype):
            continue
        if t.dtype != x.dtype:
            raise TypeError(
                f"{name}: {label} is {t.dtype.name}, x is {x.dtype.name}; cast them to one dtype"
            )
        if t.device != x.device:
            raise ValueError(f"{name}: {label} is on {t.device}, x on {x.device}")
    if W0.rank != 2 or s.rank != 1:
        raise ValueError(f"{name}: W0 must be [out, in] and s [out], got {W0.shape} and {s.shape}")
    if (U is None) != (V is None):
        raise ValueError(f"{name}: pass both U and V, or neither (rank 0)")
    if U is None or V is None:
        zero = ops.constant(0, x.dtype, device=x.device)
        U = ops.broadcast_to(zero, [W0.shape[0], 0])
        V = ops.broadcast_to(zero, [in_dim, 0])
    elif U.rank != 2 or V.rank != 2:
        raise ValueError(f"{name}: U must be [out, r] and V [in, r], got {U.shape} and {V.shape}")
    else:
        _rank_of(U, op, what)
        _rank_of(V, op, what)
    return [W0, s, U, V]


def _custom(op: str, **kwargs: Any) -> TensorValue:
    """``ops.custom``, with advice when the graph has not loaded the kernels."""
    try:
        (y,) = ops.custom(op, **kwargs)
    except ValueError as exc:
        if "no kernel registered" not in str(exc):
            raise
        raise ValueError(
            f"{op}: this graph has not loaded the attnquant kernels; create it with "
            f"Graph(..., custom_extensions=[attnquant_kernels.kernels_path()]) or inside "
            f"max.graph.default_custom_extensions_scope(attnquant_kernels.kernels_path()) "
            f"(kernels: {kernels_path()})"
        ) from exc
    return y.tensor


def _check_x(x: TensorValue, op: str) -> None:
    if x.rank != 2:
        raise ValueError(f"{op}: x must be [M, in] (fold leading dimensions first), got {x.shape}")
    if x.dtype not in _FLOAT:
        raise TypeError(f"{op}: x is {x.dtype.name}; float32 or bfloat16 expected")


def generated_linear(
    x: TensorValueLike,
    W0: TensorValueLike,
    s: TensorValueLike,
    U: TensorValueLike | None = None,
    V: TensorValueLike | None = None,
) -> TensorValue:
    """``y = s * (x @ W0^T) + (x @ V) @ U^T`` as one ``generated_linear`` dispatch.

    Parameters
    ----------
    x : TensorValue
        ``[M, K]``.
    W0, s, U, V : TensorValue or Weight
        ``[N, K]``, ``[N]``, ``[N, r]``, ``[K, r]``; ``U = V = None`` for rank 0.

    Returns
    -------
    TensorValue
        ``[M, N]``, dtype of ``x``.

    Raises
    ------
    RankError
        ``r > 64`` (static); use the GEMM formulation (``ATTNQUANT_GEMM=1``).
    """
    op = "generated_linear"
    x = TensorValue(x)
    _check_x(x, op)
    values = _operands(x, W0, s, U, V, op=op, what="", in_dim=x.shape[1])
    out = TensorType(x.dtype, [x.shape[0], W0.shape[0]], device=x.device)
    return _custom(op, device=x.device, values=[x, *values], out_types=[out])


def generated_lowrank(x: TensorValueLike, U: TensorValueLike, V: TensorValueLike) -> TensorValue:
    """``y = (x @ V) @ U^T`` as one ``generated_lowrank`` dispatch: a projection without ``W0``.

    Serves the low-rank form (``U_l``, ``V_l``) and both shared-basis forms (``V = B_b`` on
    the input side, ``U = B_b`` on the output side) without forming the ``[N, K]`` weight.
    Any rank: here ``U`` and ``V`` are the whole weight, so :data:`~attnquant_kernels.MAX_RANK`
    (a bound on the correction of a ``W0``) does not apply.

    Parameters
    ----------
    x : TensorValue
        ``[M, K]``.
    U, V : TensorValue or Weight
        ``[N, r]`` and ``[K, r]``, ``r >= 1``, dtype and device of ``x``.

    Returns
    -------
    TensorValue
        ``[M, N]``, dtype of ``x``.
    """
    op = "generated_lowrank"
    x = TensorValue(x)
    _check_x(x, op)
    U, V = TensorValue(U), TensorValue(V)
    for label, t in (("U", U), ("V", V)):
        if t.dtype != x.dtype:
            raise TypeError(
                f"{op}: {label} is {t.dtype.name}, x is {x.dtype.name}; cast them to one dtype"
            )
        if t.device != x.device:
            raise ValueError(f"{op}: {label} is on {t.device}, x on {x.device}")
        if t.rank != 2:
            raise ValueError(f"{op}: U must be [out, r] and V [in, r], got {U.shape} and {V.shape}")
    for what, got, want in (
        ("V rows", V.shape[0], x.shape[1]),
        ("V columns", V.shape[1], U.shape[1]),
    ):
        if _static(got) is not None and _static(want) is not None and int(got) != int(want):
            raise ValueError(f"{op}: {what} are {got}, expected {want} (x [M, in], U [out, r])")
    if _static(U.shape[1]) == 0:
        raise ValueError(f"{op}: rank 0 (U [out, 0]) is a zero projection; serve it as zeros")
    out = TensorType(x.dtype, [x.shape[0], U.shape[0]], device=x.device)
    return _custom(op, device=x.device, values=[x, U, V], out_types=[out])


def generated_mlp(
    x: TensorValueLike,
    gate: Sequence[TensorValueLike | None],
    up: Sequence[TensorValueLike | None],
    down: Sequence[TensorValueLike | None],
    *,
    activation: str = "silu",
) -> TensorValue:
    """``down(act(gate(x)) * up(x))`` as one ``generated_mlp`` dispatch.

    Parameters
    ----------
    x : TensorValue
        ``[M, H]``.
    gate, up : (W0, s, U, V)
        ``W0 [F, H]``, ``s [F]``, ``U [F, r]``, ``V [H, r]`` (``U = V = None``: rank 0).
    down : (W0, s, U, V)
        ``W0 [H, F]``, ``s [H]``, ``U [H, r]``, ``V [F, r]``.
    activation : str
        ``"silu"`` (Llama) or ``"gelu_tanh"`` (Gemma); the Hugging Face spellings
        ``"swish"`` and ``"gelu_pytorch_tanh"`` are accepted.

    Returns
    -------
    TensorValue
        ``[M, H]``, dtype of ``x``.
    """
    op = "generated_mlp"
    x = TensorValue(x)
    _check_x(x, op)
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"{op}: activation {activation!r} is not supported; expected one of "
            f"{', '.join(sorted(ACTIVATIONS))}"
        )
    parts: list[TensorValue] = []
    for what, proj, in_dim in (
        ("gate", gate, x.shape[1]),
        ("up", up, x.shape[1]),
        ("down", down, None),
    ):
        if len(proj) != 4:
            raise ValueError(f"{op} ({what}): expected (W0, s, U, V), got {len(proj)} tensors")
        W0, s, U, V = proj
        if W0 is None or s is None:
            raise ValueError(f"{op} ({what}): W0 and s are required")
        dim = in_dim if in_dim is not None else TensorValue(W0).shape[1]
        parts += _operands(x, W0, s, U, V, op=op, what=what, in_dim=dim)
    out = TensorType(x.dtype, [x.shape[0], x.shape[1]], device=x.device)
    return _custom(
        op,
        device=x.device,
        values=[x, *parts],
        out_types=[out],
        parameters={"activation": ACTIVATIONS[activation]},
    )


def generated_linear_nvfp4(
    x: TensorValueLike,
    weight: TensorValueLike,
    weight_scale: TensorValueLike,
    weight_scale_2: TensorValueLike,
    s: TensorValueLike | None = None,
    U: TensorValueLike | None = None,
    V: TensorValueLike | None = None,
    *,
    tiled: bool = False,
    activations: str = "float",
) -> TensorValue:
    """``y = s * (x @ W^T) + (x @ V) @ U^T`` with ``W`` held as NVFP4, one dispatch.

    ``W[n, k] = E2M1[code[n, k]] * E4M3(weight_scale[n, k // 16]) * weight_scale_2`` (Model
    Optimizer's layout) is decoded inside the kernel's dot product and never written out as
    floats, so a decode step reads 4.5 bits per weight instead of 32. On the CPU, from 16 rows
    on, each panel of 64 output columns is decoded once per call into a scratch in L2 and the
    op runs as a register-tiled GEMM over it: at 512 rows within 4-15% of the stock float32
    matmul's time on the dequantized weight (``benchmarks/bench_kernels.py --sections nvfp4``).

    Parameters
    ----------
    x : TensorValue
        ``[M, K]``, float32 or bfloat16; ``K`` a multiple of 16.
    weight : TensorValue or Weight
        uint8 ``[N, K/2]``: two E2M1 codes per byte, the even input in the low nibble.
    weight_scale : TensorValue or Weight
        uint8 ``[N, K/16]``: the float8_e4m3fn bytes of the block scales (float8 tensors do
        not compile on MAX's CPU target, so they travel as bytes).
    weight_scale_2 : TensorValue or Weight
        float32 ``[1]`` (or a scalar): the per-tensor scale.
    s : TensorValue or Weight, optional
        ``[N]``, dtype of ``x``: per-output-row scale of a theta projection; ones when omitted.
    U, V : TensorValue or Weight, optional
        ``[N, r]``, ``[K, r]``, dtype of ``x``; ``U = V = None`` for rank 0.
    tiled : bool
        ``weight`` and ``weight_scale`` hold the tiled layout of
        :func:`attnquant_kernels.layout.tile_nvfp4` (same shapes): the CPU op
        ``generated_linear_nvfp4_tiled``, whose decode step reads each tile of 16 rows as one
        stream (on AVX-512 1.3-1.4x the row-major op's speed at one row). CPU only.
    activations : {"float", "int8"}
        ``"int8"`` (tiled only): the op rounds each row of ``x`` to int8 per group of 64
        inputs (``amax / 127``) and multiplies integers (``generated_linear_nvfp4_tiled_a8``,
        AVX-512 VNNI where the CPU has it), at every row count: ``y`` is then the projection
        of ``x`` so rounded, no longer equal to the float one to 1e-4. The correction
        ``(x V) U^T`` and the outputs past the last whole tile of 16 take float ``x``.

    Returns
    -------
    TensorValue
        ``[M, N]``, dtype of ``x``.

    Raises
    ------
    RankError
        ``r > 64`` (static).
    TypeError, ValueError
        A dtype or a static shape that does not fit the layout, in one line; ``tiled`` on
        an accelerator.
    """
    if activations not in ("float", "int8"):
        raise ValueError(
            f"generated_linear_nvfp4: activations {activations!r}, not 'float' or 'int8'"
        )
    if activations == "int8" and not tiled:
        raise ValueError(
            "generated_linear_nvfp4: int8 activations read the tiled layout (tiled=True)"
        )
    op = "generated_linear_nvfp4_tiled" if tiled else "generated_linear_nvfp4"
    if activations == "int8":
        op += "_a8"
    x = TensorValue(x)
    _check_x(x, op)
    if tiled and x.device.device_type.value != "cpu":
        raise ValueError(
            f"{op}: the tiled NVFP4 layout is served on the CPU; on {x.device} use "
            "generated_linear_nvfp4 over Model Optimizer's row-major layout"
        )
    weight, weight_scale, weight_scale_2 = _nvfp4_parts(
        op, weight, weight_scale, weight_scale_2, device=x.device, in_dim=_static(x.shape[1])
    )
    n_out = weight.shape[0]
    if s is None:
        s = ops.broadcast_to(ops.constant(1, x.dtype, device=x.device), [n_out])
    values = _operands(x, weight, s, U, V, op=op, what="", in_dim=x.shape[1], w0_dtype=False)
    out = TensorType(x.dtype, [x.shape[0], n_out], device=x.device)
    return _custom(
        op,
        device=x.device,
        values=[x, weight, weight_scale, weight_scale_2, *values[1:]],
        out_types=[out],
    )


def nvfp4_dequantize(
    weight: TensorValueLike,
    weight_scale: TensorValueLike,
    weight_scale_2: TensorValueLike,
    dtype: DType = DType.float32,
    *,
    transposed: bool = False,
) -> TensorValue:
    """The float weight ``W [N, K]`` of an NVFP4 tensor (``transposed``: ``W^T [K, N]``),
    written out by one dispatch.

    ``W[n, k] = E2M1[code[n, k]] * (E4M3(weight_scale[n, k // 16]) * weight_scale_2)`` in
    float32, the reference's order, so a float32 ``W`` is bit for bit
    ``attnquant_max.dequantize_nvfp4``'s (then cast to ``dtype``). For the batches where one
    stock matmul over ``W`` beats :func:`generated_linear_nvfp4` (a long prefill on an
    accelerator, whose op is one thread per output; on the CPU the op's own GEMM is faster from
    16 rows on); a decode step should never write ``W``.

    Parameters
    ----------
    weight, weight_scale, weight_scale_2 : TensorValue or Weight
        As :func:`generated_linear_nvfp4`: uint8 ``[N, K/2]``, uint8 ``[N, K/16]``, float32
        ``[1]`` (or a scalar), on one device.
    dtype : DType
        A float dtype for ``W`` (float32, bfloat16 or float16).
    transposed : bool
        Write ``W^T``, what ``x @ W^T`` multiplies by: MAX folds the transpose of a weight into
        its matmul, but copies a computed ``W`` transposed first (12 ms of a 2048x2048 matmul
        that takes 1.6 ms at one token on this project's CPU).

    Raises
    ------
    TypeError, ValueError
        A dtype, a device or a static shape that does not fit the layout, in one line.
    """
    op = "nvfp4_dequantize"
    if dtype not in _FLOAT:
        raise TypeError(f"{op}: W must be float32, bfloat16 or float16, not {dtype.name}")
    weight = TensorValue(weight)
    weight, weight_scale, weight_scale_2 = _nvfp4_parts(
        op, weight, weight_scale, weight_scale_2, device=weight.device, in_dim=None, owner="weight"
    )
    dims = [weight.shape[0], weight.shape[1] * 2]
    out = TensorType(dtype, dims[::-1] if transposed else dims, device=weight.device)
    return _custom(
        op,
        device=weight.device,
        values=[weight, weight_scale, weight_scale_2],
        out_types=[out],
        parameters={"transposed": transposed},
    )


def _nvfp4_parts(
    op: str,
    weight: TensorValueLike,
    weight_scale: TensorValueLike,
    weight_scale_2: TensorValueLike,
    *,
    device: Any,
    in_dim: int | None,
    owner: str = "x",
) -> tuple[TensorValue, TensorValue, TensorValue]:
    """The three tensors of an NVFP4 weight as graph values, checked against the layout (and
    against ``in_dim`` inputs when static); a scalar ``weight_scale_2`` becomes ``[1]``."""
    weight, weight_scale = TensorValue(weight), TensorValue(weight_scale)
    weight_scale_2 = TensorValue(weight_scale_2)
    for label, t, dtype in (
        ("weight", weight, DType.uint8),
        ("weight_scale", weight_scale, DType.uint8),
        ("weight_scale_2", weight_scale_2, DType.float32),
    ):
        if t.dtype != dtype:
            raise TypeError(f"{op}: {label} is {t.dtype.name}, expected {dtype.name}")
        if t.device != device:
            raise ValueError(f"{op}: {label} is on {t.device}, {owner} on {device}")
    if weight.rank != 2 or weight_scale.rank != 2:
        raise ValueError(
            f"{op}: weight must be [out, in/2] and weight_scale [out, in/16], got "
            f"{weight.shape} and {weight_scale.shape}"
        )
    if weight_scale_2.rank == 0:
        weight_scale_2 = ops.reshape(weight_scale_2, [1])
    if weight_scale_2.rank != 1 or _static(weight_scale_2.shape[0]) not in (None, 1):
        raise ValueError(f"{op}: weight_scale_2 must hold one value, got {weight_scale_2.shape}")
    half, blocks = (_static(d) for d in (weight.shape[1], weight_scale.shape[1]))
    k = in_dim if in_dim is not None else (2 * half if half is not None else None)
    if k is not None and k % 16:
        what = "x has" if in_dim is not None else "weight holds"
        raise ValueError(f"{op}: {what} {k} inputs, not a multiple of 16 (one scale per 16)")
    if k is not None and half is not None and 2 * half != k:
        raise ValueError(f"{op}: weight is [out, {half}], expected [out, {k // 2}] for {k} inputs")
    if k is not None and blocks is not None and 16 * blocks != k:
        raise ValueError(
            f"{op}: weight_scale is [out, {blocks}], expected [out, {k // 16}] for {k} inputs"
        )
    rows, scale_rows = _static(weight.shape[0]), _static(weight_scale.shape[0])
    if rows is not None and scale_rows is not None and rows != scale_rows:
        raise ValueError(f"{op}: weight has {rows} rows and weight_scale {scale_rows}")
    return weight, weight_scale, weight_scale_2
