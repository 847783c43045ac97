"""attnquant-kernels: Mojo kernels for the theta identity, shipped as package data.

The kernels live in a Mojo package folder (``mojo/`` with an ``__init__.mojo``) that MAX compiles
when a graph names it in ``custom_extensions``. They register seven custom ops (:data:`KERNEL_OPS`):

* ``generated_linear``: ``y = s * (x @ W0^T) + (x @ V) @ U^T``, one dispatch per projection;
* ``generated_mlp``: ``down(act(gate(x)) * up(x))`` over three theta projections, one dispatch;
* ``generated_linear_nvfp4``: ``generated_linear`` with ``W0`` held as NVFP4 (packed E2M1 codes,
  E4M3 block scales, a float32 global scale), decoded inside the dot product;
* ``nvfp4_dequantize``: the float weight of an NVFP4 tensor written out once, bit for bit the
  reference's, for the batches where one stock matmul beats the fused op (a long prefill);
* ``generated_lowrank``: ``y = (x @ V) @ U^T``, a projection without ``W0`` (low rank, or a
  basis shared by a band on either side), any rank;
* ``generated_linear_nvfp4_tiled``: ``generated_linear_nvfp4`` on the CPU over the tiled layout
  of :func:`attnquant_kernels.layout.tile_nvfp4` (each tile of 16 rows one stream);
* ``generated_linear_nvfp4_tiled_a8``: the tiled op with the activations rounded to int8 per
  group of 64 inputs at every row count, multiplied as integers (W4A8, VNNI where present).

The theta ops refuse a correction rank above :data:`MAX_RANK` (64) with an error naming the GEMM path
(``ATTNQUANT_GEMM=1``). This module imports neither numpy nor MAX; the graph-building helpers
are in :mod:`attnquant_kernels.graph`, which imports ``max``, the tiled layout in
:mod:`attnquant_kernels.layout` (numpy).
"""

from importlib.metadata import PackageNotFoundError, version

from ._locate import KERNEL_OPS, MAX_RANK, RankError, check_rank, kernels_path, mojo_sources

try:
    __version__ = version("attnquant-kernels")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = [
    # the custom ops
    "KERNEL_OPS",
    "MAX_RANK",
    "RankError",
    "check_rank",
    # locating the Mojo package
    "kernels_path",
    "mojo_sources",
    "__version__",
]
