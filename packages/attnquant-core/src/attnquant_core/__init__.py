"""attnquant-core: theta bundles for the linear projections of decoder LLMs, in numpy.

Each projection family (``self_attn.q_proj`` ... ``mlp.down_proj``) is stored as a shared block
``W0`` per band of layers, a per-row scale ``s`` and a low-rank correction ``U V^T``::

    W_eff = diag(s) @ W0 + U @ V.T          y = s * (W0 x) + U (V^T x)

This package decomposes checkpoints, rebuilds and applies the identity, reads and writes
theta checkpoints, and measures error against compression. It never imports MAX.
"""

from importlib.metadata import PackageNotFoundError, version

from ._analysis import (
    FamilyReport,
    ModelReport,
    SweepPoint,
    SweepResult,
    analyze_checkpoint,
    relative_error,
    stored_parameters,
    sweep,
)
from ._bands import band_of_layers, band_sizes, resolve_blocks
from ._checkpoint import FAMILIES, Checkpoint, FamilyInfo, open_checkpoint, parse_projection_key
from ._decompose import (
    FamilyErrors,
    LayerFit,
    SVDOptions,
    decompose_family,
    fit_layer,
    pooled_error,
    row_scale,
)
from ._errors import (
    AttnquantError,
    BandMismatchError,
    CheckpointError,
    DecompositionError,
    ThetaFormatError,
)
from ._format import (
    FORMAT_VERSION,
    MANIFEST_FILE,
    DecomposeProgress,
    ThetaCheckpoint,
    atomic_directory,
    copy_side_files,
    decompose_checkpoint,
    is_theta_checkpoint,
    rebuild_dense_state,
    save_theta,
    shared_key,
    theta_key,
)
from ._safetensors_io import dtype_from_name, dtype_name
from ._svd import LowRank, compute_dtype, randomized_svd, truncated_svd
from ._theta import FamilyTheta, LayerTheta, ThetaModel, apply, reconstruct

try:
    __version__ = version("attnquant-core")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = [
    # theta types and the identity
    "FamilyTheta",
    "LayerTheta",
    "ThetaModel",
    "apply",
    "reconstruct",
    # decomposition
    "FamilyErrors",
    "LayerFit",
    "SVDOptions",
    "band_of_layers",
    "band_sizes",
    "decompose_family",
    "fit_layer",
    "resolve_blocks",
    "row_scale",
    # truncated SVD
    "LowRank",
    "compute_dtype",
    "randomized_svd",
    "truncated_svd",
    # checkpoints
    "FAMILIES",
    "Checkpoint",
    "FamilyInfo",
    "open_checkpoint",
    "parse_projection_key",
    "dtype_from_name",
    "dtype_name",
    # the theta checkpoint
    "FORMAT_VERSION",
    "MANIFEST_FILE",
    "DecomposeProgress",
    "ThetaCheckpoint",
    "atomic_directory",
    "copy_side_files",
    "decompose_checkpoint",
    "is_theta_checkpoint",
    "rebuild_dense_state",
    "save_theta",
    "shared_key",
    "theta_key",
    # analysis
    "FamilyReport",
    "ModelReport",
    "SweepPoint",
    "SweepResult",
    "analyze_checkpoint",
    "sweep",
    "pooled_error",
    "relative_error",
    "stored_parameters",
    # errors
    "AttnquantError",
    "BandMismatchError",
    "CheckpointError",
    "DecompositionError",
    "ThetaFormatError",
    "__version__",
]
