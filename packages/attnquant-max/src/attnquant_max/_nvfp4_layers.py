"""NVFP4 weights kept packed in device memory and dequantized inside the graph (emulated path).

Where the device has no FP4 matmul (the CPU, H100/H200), ``ATTNQUANT_QUANT=nvfp4`` serves each
projection from three tensors, the names and contents of Model Optimizer's layout
(:mod:`attnquant_max._nvfp4`):

``<prefix>.weight``          uint8   ``[out, in/2]``   two E2M1 codes per byte, even input low
``<prefix>.weight_scale``    uint8   ``[out, in/16]``  the float8_e4m3fn bytes of the block scales
``<prefix>.weight_scale_2``  float32 ``[1]``           the per-tensor scale

The scales travel as raw bytes because float8 tensors do not compile on MAX's CPU target. On
every forward the graph rebuilds ``W`` with two gathers and one multiply, exactly as
:func:`attnquant_max._nvfp4.dequantize_nvfp4` does in numpy:

* ``ops.gather`` of a ``[256, 2]`` table by byte: both E2M1 values of a byte at once, low nibble
  first, so no integer shifts or masks are needed;
* ``ops.gather`` of the 256 float8_e4m3fn values by scale byte;
* ``W = E2M1 * (scale * scale_2)``, float32, then cast to the activation dtype and one matmul.

So the weights held are 4.5 bits per element (plus one float per tensor), the matmul is the
stock one, and the dequantization costs one pass over ``W`` per projection per step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from max.dtype import DType
from max.graph import DeviceRef, TensorValue, Weight, ops
from max.nn import Module

from ._nvfp4 import BLOCK_SIZE, E2M1_VALUES, E4M3_VALUES, check_nvfp4_shape

__all__ = [
    "E2M1_PAIR_TABLE",
    "NVFP4Linear",
    "NVFP4StackedLinear",
    "dequantize_in_graph",
]

#: ``E2M1_PAIR_TABLE[b] = (E2M1[b & 15], E2M1[b >> 4])``: both values a packed byte holds.
E2M1_PAIR_TABLE = np.stack(
    [E2M1_VALUES[np.arange(256) & 0x0F], E2M1_VALUES[np.arange(256) >> 4]], axis=1
).astype(np.float32)

# float8_e4m3fn bytes 0x7F and 0xFF are NaN; a quantizer never writes them (scales are finite
# and non-negative), so the table maps them to NaN too and a corrupt byte shows up as NaN.
_E4M3_TABLE = E4M3_VALUES.astype(np.float32)


def dequantize_in_graph(
    weight: TensorValue, weight_scale: TensorValue, weight_scale_2: TensorValue, dtype: DType
) -> TensorValue:
    """``W [out, in]`` of ``dtype`` from packed codes, E4M3 scale bytes and the per-tensor scale.

    Float32 arithmetic in the reference's order: ``E2M1[code] * (scale * scale_2)``.
    """
    device = weight.device
    out_dim, half = (int(d) for d in weight.shape)
    in_dim = 2 * half
    pairs = ops.constant(E2M1_PAIR_TABLE, DType.float32, device=device)
    values = ops.gather(pairs, ops.cast(weight, DType.int32), axis=0)  # [out, in/2, 2]
    values = ops.reshape(values, [out_dim, in_dim // BLOCK_SIZE, BLOCK_SIZE])
    table = ops.constant(_E4M3_TABLE, DType.float32, device=device)
    scales = ops.gather(table, ops.cast(weight_scale, DType.int32), axis=0)  # [out, in/16]
    step = scales * ops.reshape(weight_scale_2, [])
    W = ops.reshape(values * ops.unsqueeze(step, -1), [out_dim, in_dim])
    return ops.cast(W, dtype) if dtype != DType.float32 else W


class NVFP4Linear(Module):
    """``y = x @ W^T`` with ``W`` held as NVFP4 and dequantized in the graph (no bias).

    Weights ``weight`` (uint8 ``[out, in/2]``), ``weight_scale`` (uint8 ``[out, in/16]``,
    float8_e4m3fn bytes) and ``weight_scale_2`` (float32 ``[1]``), the checkpoint's names.
    ``dtype`` is the activation dtype the dequantized weight is cast to.
    """

    def __init__(self, in_dim: int, out_dim: int, *, dtype: DType, device: DeviceRef) -> None:
        super().__init__()
        check_nvfp4_shape((out_dim, in_dim))
        self.in_dim, self.out_dim, self.dtype = in_dim, out_dim, dtype
        self.weight = Weight("weight", DType.uint8, [out_dim, in_dim // 2], device=device)
        self.weight_scale = Weight(
            "weight_scale", DType.uint8, [out_dim, in_dim // BLOCK_SIZE], device=device
        )
        self.weight_scale_2 = Weight("weight_scale_2", DType.float32, [1], device=device)

    def dequantized(self, device: DeviceRef) -> TensorValue:
        """The dense ``W [out, in]``, rebuilt in the graph."""
        return dequantize_in_graph(
            TensorValue(self.weight).to(device),
            TensorValue(self.weight_scale).to(device),
            TensorValue(self.weight_scale_2).to(device),
            self.dtype,
        )

    def __call__(self, x: TensorValue) -> TensorValue:
        return x @ self.dequantized(x.device).T


class NVFP4StackedLinear(Module):
    """Projections of one input (q/k/v, gate/up): dequantized, concatenated, one matmul.

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
        W = ops.concat([m.dequantized(x.device) for m in self.members], axis=0)
        return x @ W.T
