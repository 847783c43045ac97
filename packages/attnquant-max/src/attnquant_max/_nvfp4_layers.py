"""NVFP4 weights kept packed in device memory, dequantized in the graph or decoded by a fused op.

Where the device has no FP4 matmul (the CPU, H100/H200), ``ATTNQUANT_QUANT=nvfp4`` serves each
projection from three tensors, the names and contents of Model Optimizer's layout
(:mod:`attnquant_core.forms`):

``<prefix>.weight``          uint8   ``[out, in/2]``   two E2M1 codes per byte, even input low
``<prefix>.weight_scale``    uint8   ``[out, in/16]``  the float8_e4m3fn bytes of the block scales
``<prefix>.weight_scale_2``  float32 ``[1]``           the per-tensor scale

The scales travel as raw bytes because float8 tensors do not compile on MAX's CPU target. On
every forward the graph rebuilds ``W`` with two gathers and one multiply, exactly as
:func:`attnquant_core.forms.dequantize_nvfp4` does in numpy:

* ``ops.gather`` of a ``[256, 2]`` table by byte: both E2M1 values of a byte at once, low nibble
  first, so no integer shifts or masks are needed;
* ``ops.gather`` of the 256 float8_e4m3fn values by scale byte;
* ``W = E2M1 * (scale * scale_2)``, float32, then cast to the activation dtype and one matmul.

So the weights held are 4.5 bits per element (plus one float per tensor), the matmul is the
stock one, and the dequantization costs one pass over ``W`` per projection per step.

With ``fused=True`` a projection is instead one ``generated_linear_nvfp4`` dispatch
(attnquant-kernels), which decodes the packed codes inside its dot product and never writes
``W`` out: a decode step reads 4.5 bits per weight. :func:`nvfp4_fused` makes the choice once
per process and device by timing both on one projection at start-up, and logs it. On the CPU
the op serves every batch: from 16 rows on it decodes each panel of 64 output columns once per
call and runs a register-tiled GEMM over it, at 512 rows within 4-15% of the stock float32
matmul's time (``benchmarks/bench_kernels.py --sections nvfp4``). On an accelerator, whose op is one thread
per output, a fused projection branches on the tokens of the forward (``ops.cond``, both
branches compiled into one graph): from :data:`DENSE_FROM_ROWS` rows on it writes its float
weight once (``nvfp4_dequantize``, attnquant-kernels, bit for bit the reference's) and runs the
stock matmul, below it dispatches the fused op (``dense_from_rows`` sets the threshold, or
turns the branch off or on, per layer).

On a CPU with AVX-512 (:func:`nvfp4_tiled`) a fused projection reads the tiled layout instead
(``tiled=True``: ``generated_linear_nvfp4_tiled``): the model's owner rewrites each packed
weight and its scales at load with :func:`attnquant_kernels.layout.tile_nvfp4`, the same bytes
in the same shapes with each tile of 16 rows transposed, so a decode step reads one contiguous
stream per tile (1.24-1.37x the row-major op's speed at one row, standalone).

Fused in float32, projections of one input (q/k/v, gate/up) are one dispatch each: the model's
owner concatenates their packed rows and scales at load (:func:`merge_nvfp4`) and
:class:`NVFP4MergedLinear` carries their differing per-tensor scales as a row scale, where
:class:`NVFP4StackedLinear` runs one dispatch per member and a concat (bfloat16, whose row
scale would round them).

The same layer serves a theta checkpoint whose ``W0`` is stored in NVFP4 (format version 4)
in the graph: ``theta=True`` adds the layer's ``theta_s`` (and, at ``rank > 0``, ``theta_U``,
``theta_V``), and ``band`` hands it the three packed tensors of its band, owned once per band
by the model (:class:`~attnquant_max._layers.ThetaSharedBlocks`), so the projection is
``y = s * (x W0^T) + (x V) U^T`` with ``W0`` decoded from 4.5 bits per weight: one
``generated_linear_nvfp4(x, W0_packed, W0_scale, W0_scale_2, s, U, V)`` dispatch (fused), or
``W0`` dequantized in the graph, one matmul, the row scale and two matmuls for ``U V^T``
(dequantize). Without ``theta`` the graph is exactly the ``ATTNQUANT_QUANT=nvfp4`` one.

The graph pieces under these layers (:func:`dequantize_in_graph`, :func:`by_rows`,
:func:`on_rows`, :func:`packed_specs`) and the start-up measurement (:func:`measure_nvfp4`,
:func:`nvfp4_tiled`) live in :mod:`attnquant_max._nvfp4_graph` and are re-exported here.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Literal

import numpy as np
from max.dtype import DType
from max.graph import DeviceRef, TensorValue, Weight, ops
from max.nn import Module

from attnquant_core.forms import check_nvfp4_shape
from attnquant_kernels import MAX_RANK
from attnquant_kernels.graph import generated_linear_nvfp4, nvfp4_dequantize

from ._nvfp4_graph import (
    DENSE_FROM_ROWS,
    E2M1_PAIR_TABLE,
    NVFP4Band,
    by_rows,
    dequantize_in_graph,
    measure_nvfp4,
    nvfp4_tiled,
    on_rows,
    packed_specs,
)

__all__ = [
    "DENSE_FROM_ROWS",
    "E2M1_PAIR_TABLE",
    "NVFP4Band",
    "NVFP4Linear",
    "NVFP4MergedLinear",
    "NVFP4StackedLinear",
    "dequantize_in_graph",
    "measure_nvfp4",
    "merge_nvfp4",
    "nvfp4_fused",
    "nvfp4_tiled",
    "packed_specs",
]

logger = logging.getLogger(__name__)


class NVFP4Linear(Module):
    """``y = x @ W^T`` with ``W`` held as NVFP4 (no bias): dequantized in the graph, or with
    ``fused=True`` one ``generated_linear_nvfp4`` dispatch (on an accelerator only below
    :data:`DENSE_FROM_ROWS` rows, from there on ``nvfp4_dequantize`` and one matmul); with
    ``theta=True`` the theta projection ``y = s * (x W0^T) + (x V) U^T`` over an NVFP4 ``W0``.

    Parameters
    ----------
    in_dim, out_dim : int
        ``W`` is ``[out_dim, in_dim]``; ``in_dim`` a multiple of 16.
    dtype : DType
        The activation dtype (the dequantized weight is cast to it; ``s``, ``U``, ``V`` are in it).
    device : DeviceRef
    fused : bool
        Load the kernels: one ``generated_linear_nvfp4`` dispatch (below ``dense_from_rows``);
        not: dequantize in the graph with gathers, then one matmul, at every batch.
    band : NVFP4Band, optional
        The packed ``W0`` of this layer's band, registered by its owner (one copy per band);
        this module holds a reference. ``None``: the module owns ``weight``,
        ``weight_scale`` (uint8 ``[out, in/16]``, float8_e4m3fn bytes) and ``weight_scale_2``
        (float32 ``[1]``), the checkpoint names of ``ATTNQUANT_QUANT=nvfp4``.
    theta : bool
        Hold ``theta_s [out]`` and scale the rows by it.
    rank : int
        With ``theta``: hold ``theta_U [out, r]`` and ``theta_V [in, r]`` and add ``(x V) U^T``
        (inside the fused op up to ``attnquant_kernels.MAX_RANK``, two matmuls above it).
    dense_from_rows : int, None or "auto"
        Fused: the rows from which the weight is written by ``nvfp4_dequantize`` and one stock
        matmul runs instead of the op (:func:`by_rows`); ``None``: the op at every batch.
        ``"auto"``: :data:`DENSE_FROM_ROWS` on an accelerator, ``None`` on the CPU.
    tiled : bool
        Fused on the CPU: the packed weight and scales hold the tiled layout
        (:func:`attnquant_kernels.layout.tile_nvfp4`, written at load by the model's owner),
        read by ``generated_linear_nvfp4_tiled`` (:func:`nvfp4_tiled`).
    int8 : bool
        Tiled: at every row count the op rounds the activations to int8 per group of 64 inputs
        and multiplies integers (``generated_linear_nvfp4_tiled_a8``, ``--nvfp4-int8``).
    """

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        *,
        dtype: DType,
        device: DeviceRef,
        fused: bool = False,
        band: NVFP4Band | None = None,
        theta: bool = False,
        rank: int = 0,
        dense_from_rows: int | Literal["auto"] | None = "auto",
        tiled: bool = False,
        int8: bool = False,
    ) -> None:
        super().__init__()
        check_nvfp4_shape((out_dim, in_dim))
        if tiled and not (fused and device.device_type.value == "cpu"):
            raise ValueError("NVFP4Linear: the tiled layout is read by the fused op on the CPU")
        if int8 and not tiled:
            raise ValueError("NVFP4Linear: int8 activations are read by the tiled op (tiled=True)")
        self.tiled, self.int8 = tiled, int8
        if dense_from_rows == "auto":
            dense_from_rows = None if device.device_type.value == "cpu" else DENSE_FROM_ROWS
        self.dense_from_rows = dense_from_rows
        if rank and not theta:
            raise ValueError("NVFP4Linear: a correction of rank > 0 needs theta=True")
        self.in_dim, self.out_dim, self.dtype, self.fused = in_dim, out_dim, dtype, fused
        self.theta, self.rank = theta, rank
        _hold_packed(self, out_dim, in_dim, device, band)
        if theta:
            self.theta_s = Weight("theta_s", dtype, [out_dim], device=device)
        if rank:
            self.theta_U = Weight("theta_U", dtype, [out_dim, rank], device=device)
            self.theta_V = Weight("theta_V", dtype, [in_dim, rank], device=device)

    def _packed(self, device: DeviceRef) -> tuple[TensorValue, TensorValue, TensorValue]:
        w, ws, ws2 = self._band
        return (
            TensorValue(w).to(device),
            TensorValue(ws).to(device),
            TensorValue(ws2).to(device),
        )

    def dequantized(self, device: DeviceRef) -> TensorValue:
        """The dense ``W [out, in]`` (``W0`` of a theta layer), rebuilt in the graph with two
        gathers and a multiply."""
        self._row_major("dequantized in the graph")
        return dequantize_in_graph(*self._packed(device), self.dtype)

    def _row_major(self, what: str) -> None:
        if self.tiled:  # a tiled weight read as row-major would be a silent wrong answer
            raise ValueError(f"NVFP4Linear: a weight in the tiled layout cannot be {what}")

    def matmul(self, x: TensorValue) -> TensorValue:
        """``x W^T`` over the dense weight: where the kernels are loaded (``fused``),
        ``nvfp4_dequantize`` writes ``W^T`` itself (MAX would copy a computed ``W``
        transposed), else :meth:`dequantized`; the same float32 values either way."""
        if self.fused:
            self._row_major("dequantized by nvfp4_dequantize")
            return x @ nvfp4_dequantize(*self._packed(x.device), self.dtype, transposed=True)
        return x @ self.dequantized(x.device).T

    def correction(self, x: TensorValue) -> TensorValue:
        """``(x V) U^T`` (theta layers of ``rank > 0``)."""
        return (x @ self.theta_V.to(x.device)) @ self.theta_U.to(x.device).T

    def finish(self, h: TensorValue, x: TensorValue) -> TensorValue:
        """``s * h + (x V) U^T`` from ``h = x W0^T`` (``h`` itself without ``theta``)."""
        if not self.theta:
            return h
        y = h * self.theta_s.to(x.device)
        return y + self.correction(x) if self.rank else y

    @property
    def branches(self) -> bool:
        """Fused, with a ``dense_from_rows`` and the whole correction inside the op: the rows
        pick the op or the dense matmul (:func:`by_rows`). Above the op's rank limit the
        correction's matmuls on ``x`` would sit beside the dense branch's, which MAX 26.7
        cannot compile (see :func:`by_rows`), so such a projection runs the op at every batch."""
        return self.fused and self.dense_from_rows is not None and self.rank <= MAX_RANK

    def dense_call(self, x: TensorValue) -> TensorValue:
        """The projection over the dense weight: one matmul, then the row scale and correction."""
        return self.finish(self.matmul(x), x)

    def kernel_call(self, flat: TensorValue) -> TensorValue:
        """The projection of ``flat [M, in]`` as one ``generated_linear_nvfp4`` dispatch (above
        the op's rank limit, the correction as two matmuls after it)."""
        s = TensorValue(self.theta_s).to(flat.device) if self.theta else None
        in_kernel = 0 < self.rank <= MAX_RANK
        U = TensorValue(self.theta_U).to(flat.device) if in_kernel else None
        V = TensorValue(self.theta_V).to(flat.device) if in_kernel else None
        y = generated_linear_nvfp4(
            flat,
            *self._packed(flat.device),
            s,
            U,
            V,
            tiled=self.tiled,
            activations="int8" if self.int8 else "float",
        )
        if self.rank > MAX_RANK:
            y = y + self.correction(flat)
        return y

    def fused_call(self, x: TensorValue, *, branch: bool = True) -> TensorValue:
        """The fused projection (leading dims folded): the op below ``dense_from_rows`` rows,
        the dense weight and one matmul from there on (:func:`by_rows`); the op at every batch
        with ``branch=False`` or where it does not :attr:`branches`."""
        if not (branch and self.branches):
            return on_rows(x, self.in_dim, self.out_dim, self.kernel_call)
        return on_rows(
            x,
            self.in_dim,
            self.out_dim,
            lambda flat: by_rows(
                flat,
                self.out_dim,
                lambda: self.kernel_call(flat),
                lambda: self.dense_call(flat),
                self.dense_from_rows,
            ),
        )

    def __call__(self, x: TensorValue) -> TensorValue:
        if self.fused:
            return self.fused_call(x)
        return self.dense_call(x)


def _hold_packed(
    module: Module, out_dim: int, in_dim: int, device: DeviceRef, band: NVFP4Band | None
) -> None:
    """Give ``module`` the three weights of an NVFP4 ``[out_dim, in_dim]`` weight as ``_band``:
    its own (``weight``, ``weight_scale``, ``weight_scale_2``, registered) when ``band`` is
    ``None``, else a reference to ``band`` (registered by its owner), checked for shape."""
    specs = packed_specs(out_dim, in_dim)
    shapes = [shape for _, shape in specs]
    if band is None:
        module.weight, module.weight_scale, module.weight_scale_2 = (
            Weight(name, dt, shape, device=device)
            for name, (dt, shape) in zip(
                ("weight", "weight_scale", "weight_scale_2"), specs, strict=True
            )
        )
        band = (module.weight, module.weight_scale, module.weight_scale_2)
    else:
        got = [list(w.shape.static_dims) for w in band]
        if got != shapes or [w.dtype for w in band] != [dt for dt, _ in specs]:
            raise ValueError(
                f"NVFP4 band {band[0].name}: {got} does not hold a [{out_dim}, {in_dim}] "
                f"NVFP4 weight (expected {shapes}, uint8/uint8/float32)"
            )
    # A reference, not a registered weight, when the band's owner registers it.
    object.__setattr__(module, "_band", band)


class NVFP4StackedLinear(Module):
    """Projections of one input (q/k/v, gate/up): dequantized, concatenated, one matmul (then
    each theta member's row scale and correction on its columns), or, fused, one dispatch each
    (on an accelerator only below the members' ``dense_from_rows``, from there on one matmul
    each over ``nvfp4_dequantize``'s weights).

    The stock ``StackedLinear`` concatenates its members' weights the same way; its own
    attribute name is left out of the weight names (``self_attn.q_proj.weight``).
    """

    @property
    def _omit_module_attr_name(self) -> bool:
        return True

    def __init__(self, members: Sequence[NVFP4Linear], names: Sequence[str]) -> None:
        super().__init__()
        if len(members) != len(names) or not members:
            raise ValueError("NVFP4StackedLinear needs one name per member")
        if len({m.in_dim for m in members}) != 1:
            raise ValueError(f"{list(names)}: stacked projections need one input size")
        self._names = list(names)
        for name, member in zip(names, members, strict=True):
            setattr(self, name, member)
        self.out_dims = [m.out_dim for m in members]

    @property
    def members(self) -> list[NVFP4Linear]:
        return [getattr(self, name) for name in self._names]

    def __call__(self, x: TensorValue) -> TensorValue:
        members = self.members
        if not all(m.fused for m in members):
            return self.dense_call(x)
        out_dim = sum(self.out_dims)

        def rows(flat: TensorValue) -> TensorValue:
            def kernel() -> TensorValue:  # one fused dispatch per member, side by side
                return ops.concat([m.kernel_call(flat) for m in members], axis=-1)

            thresholds = {m.dense_from_rows for m in members}
            if not all(m.branches for m in members) or len(thresholds) > 1:
                return kernel()  # the op at every batch (see NVFP4Linear.branches)
            return by_rows(
                flat,
                out_dim,
                kernel,
                lambda: ops.concat([m.dense_call(flat) for m in members], axis=-1),
                thresholds.pop(),
            )

        return on_rows(x, members[0].in_dim, out_dim, rows)

    def dense_call(self, x: TensorValue) -> TensorValue:
        """The members' dense weights concatenated, one matmul, then each theta member's row
        scale and correction on its columns."""
        members = self.members
        W = ops.concat([m.dequantized(x.device) for m in members], axis=0)
        h = x @ W.T
        if not any(m.theta for m in members):
            return h
        outs, start = [], 0
        for m in members:
            outs.append(m.finish(h[..., start : start + m.out_dim], x))
            start += m.out_dim
        return ops.concat(outs, axis=-1)


class NVFP4MergedLinear(NVFP4Linear):
    """Projections of one input (q/k/v, gate/up) held as one NVFP4 weight: one fused dispatch a
    forward where :class:`NVFP4StackedLinear` runs one per member and a concat.

    The members' packed rows and block scales are concatenated at load (:func:`merge_nvfp4`);
    their per-tensor scales, which differ, become a float32 row scale ``theta_s`` (each member's
    ``weight_scale_2`` on its rows) and the merged ``weight_scale_2`` is 1, so ``y = s * (x W^T)``
    is the members' outputs side by side. Float32 activations only: a bfloat16 row scale would
    round the per-tensor scales. ``out_dims`` are the members' sizes (a stacked layer's).
    """

    def __init__(
        self,
        in_dim: int,
        out_dims: Sequence[int],
        *,
        dtype: DType,
        device: DeviceRef,
        fused: bool = False,
        tiled: bool = False,
        int8: bool = False,
    ) -> None:
        if dtype != DType.float32:
            raise ValueError(
                f"NVFP4MergedLinear: float32 activations only (got {dtype}); a {dtype} row scale "
                "would round the members' per-tensor scales"
            )
        super().__init__(
            in_dim,
            sum(out_dims),
            dtype=dtype,
            device=device,
            fused=fused,
            theta=True,
            tiled=tiled,
            int8=int8,
        )
        self.out_dims = list(out_dims)


def merge_nvfp4(
    members: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The tensors of :class:`NVFP4MergedLinear` from its members' ``(weight, weight_scale,
    weight_scale_2)``: ``(weight, weight_scale, weight_scale_2 = [1], theta_s)``, the packed rows
    and scale bytes concatenated in order, ``theta_s`` float32 with each member's per-tensor
    scale on its rows. Row-major bytes (merge before tiling)."""
    if not members:
        raise ValueError("merge_nvfp4 needs at least one member")
    widths = {(w.shape[1], ws.shape[1]) for w, ws, _ in members}
    if len(widths) != 1:
        raise ValueError(f"merge_nvfp4: members of different input sizes ({sorted(widths)})")
    weight = np.concatenate([w for w, _, _ in members], axis=0)
    weight_scale = np.concatenate([ws for _, ws, _ in members], axis=0)
    row_scale = np.concatenate(
        [np.full(w.shape[0], np.asarray(ws2, np.float32).reshape(-1)[0]) for w, _, ws2 in members]
    ).astype(np.float32)
    return weight, weight_scale, np.ones(1, np.float32), row_scale


@functools.cache
def nvfp4_fused(device: DeviceRef, out_dim: int, in_dim: int) -> bool:
    """Serve NVFP4 projections with the fused op on ``device``? Measured once per process.

    Times both forms on one ``[out, in]`` projection at batch 1 (:func:`measure_nvfp4`) and
    logs the choice with the figures; the faster one is served, the fused op only when its
    output agrees with the dequantized form's to 1e-4 (otherwise a warning says so).
    """
    seconds = measure_nvfp4(device, out_dim, in_dim)
    agrees = seconds["max_rel_difference"] <= 1e-4
    if not agrees:
        logger.warning(
            "NVFP4: generated_linear_nvfp4 on %s differs from the dequantized form by %.2e "
            "(relative); serving the dequantized form",
            device,
            seconds["max_rel_difference"],
        )
    fused = agrees and seconds["fused"] <= seconds["dequantize"]
    logger.info(
        "NVFP4 projections on %s: %s (measured at start-up on one %dx%d projection, batch 1: "
        "fused generated_linear_nvfp4 %.3f ms, dequantize in the graph + matmul %.3f ms)",
        device,
        ("fused generated_linear_nvfp4" + ("_tiled" if nvfp4_tiled(device) else ""))
        if fused
        else "dequantized in the graph, then matmul",
        out_dim,
        in_dim,
        seconds["fused"] * 1e3,
        seconds["dequantize"] * 1e3,
    )
    return fused
