"""NVFP4 in numpy: re-exported from attnquant-core, where the reference now lives.

The quantizer, dequantizer and nibble packing of NVIDIA Model Optimizer's layout (bit-exact with
modelopt and MAX's loader) moved to :mod:`attnquant_core.forms` so that the 4-bit ``W0`` of a
theta checkpoint can use it without MAX; every name below is the very object core exports.
"""

from __future__ import annotations

from attnquant_core.forms import (
    BLOCK_SIZE,
    E2M1_MAX,
    E2M1_VALUES,
    E4M3_MAX,
    E4M3_MIN_SUBNORMAL,
    E4M3_VALUES,
    NVFP4Error,
    NVFP4Tensor,
    check_nvfp4_shape,
    dequantize_nvfp4,
    e2m1_codes,
    nvfp4_error_bound,
    pack_nibbles,
    quantize_nvfp4,
    unpack_nibbles,
)

__all__ = [
    "BLOCK_SIZE",
    "E2M1_MAX",
    "E2M1_VALUES",
    "E4M3_MAX",
    "E4M3_MIN_SUBNORMAL",
    "E4M3_VALUES",
    "NVFP4Error",
    "NVFP4Tensor",
    "check_nvfp4_shape",
    "dequantize_nvfp4",
    "e2m1_codes",
    "nvfp4_error_bound",
    "pack_nibbles",
    "quantize_nvfp4",
    "unpack_nibbles",
]
