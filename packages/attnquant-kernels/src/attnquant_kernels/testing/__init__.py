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

The references live in :mod:`._reference`, the float op graphs and their checks in
:mod:`._graphs`, the NVFP4 ones in :mod:`._nvfp4`; every name is re-exported here.
"""

from __future__ import annotations

from ._graphs import (
    Device,
    OpModel,
    build_linear,
    build_lowrank,
    build_mlp,
    check_linear,
    check_lowrank,
    check_mlp,
    session_model,
)
from ._nvfp4 import (
    E2M1 as E2M1,
)
from ._nvfp4 import (
    build_linear_nvfp4,
    build_linear_nvfp4_tiled,
    build_linear_nvfp4_tiled_a8,
    check_linear_nvfp4,
    check_linear_nvfp4_tiled,
    check_linear_nvfp4_tiled_a8,
    nvfp4_dequantize,
    nvfp4_random,
    quantize_activations_a8,
)
from ._reference import (
    BF16_RTOL,
    F32_RTOL,
    Report,
    apply,
    close,
    gelu_tanh,
    max_rel_error,
    mlp_ref,
    rank0,
    round_bf16,
    silu,
    theta,
)

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
    "build_linear_nvfp4_tiled_a8",
    "build_lowrank",
    "build_mlp",
    "check_linear",
    "check_linear_nvfp4",
    "check_linear_nvfp4_tiled",
    "check_linear_nvfp4_tiled_a8",
    "check_lowrank",
    "check_mlp",
    "close",
    "gelu_tanh",
    "max_rel_error",
    "mlp_ref",
    "nvfp4_dequantize",
    "nvfp4_random",
    "quantize_activations_a8",
    "rank0",
    "round_bf16",
    "session_model",
    "silu",
    "theta",
]
