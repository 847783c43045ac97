"""attnquant-core: theta bundles for the linear projections of decoder LLMs, in numpy.

Each projection family (``self_attn.q_proj`` ... ``mlp.down_proj``) is stored in one form of
the identity::

    W_eff = diag(s) @ W0 + U @ V.T          y = s * (W0 x) + U (V^T x)

``banded`` (a shared block ``W0`` per band of layers, per-row scale ``s``, low-rank correction),
``lowrank`` (``s`` and ``W0`` absent) or ``shared_basis`` (``U`` or ``V`` shared by a band).
This package decomposes checkpoints (at fixed ``G``, ``r`` or at a global parameter budget),
rebuilds and applies the identity, reads and writes theta checkpoints, and measures error
against compression. It never imports MAX.
"""

from importlib.metadata import PackageNotFoundError, version

from ._align import (
    ALIGN_MANIFEST_FILE,
    ALIGN_TRANSFORMS_FILE,
    AlignError,
    AlignReport,
    AlignTransforms,
    align_checkpoint,
    align_state,
    load_align_transforms,
    unalign_state,
)
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
from ._benchstats import (
    EXIT_CODES,
    LoadReading,
    MachineLoad,
    Order,
    PairedRuns,
    RatioInterval,
    gate_verdict,
    machine_load,
    paired_order,
    paired_ratio,
    read_load,
    run_paired,
    unpaired_ratio,
)
from ._budget import (
    BUDGET_EXACT_MAX_DIM,
    BudgetReport,
    FamilyChoice,
    FrontierPoint,
    budget_frontier,
    check_budget,
    decompose_budget,
    fit_budget,
)
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
    IntegrityError,
    ThetaFormatError,
)
from ._format import (
    FORMAT_VERSION,
    MANIFEST_FILE,
    DecomposeProgress,
    ThetaCheckpoint,
    atomic_directory,
    basis_key,
    copy_side_files,
    decompose_checkpoint,
    is_theta_checkpoint,
    rebuild_dense_state,
    save_theta,
    shared_key,
    theta_key,
)
from ._forms import LowRankFamily, SharedBasisFamily
from ._integrity import IntegrityReport, check_checkpoint, require_intact
from ._safetensors_io import DIGESTS_FILE, dtype_from_name, dtype_name
from ._svd import LowRank, compute_dtype, randomized_svd, truncated_svd
from ._theta import FORMS, FamilyTheta, LayerTheta, ThetaFamily, ThetaModel, apply, reconstruct

try:
    __version__ = version("attnquant-core")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = [
    # function-preserving alignment
    "ALIGN_MANIFEST_FILE",
    "ALIGN_TRANSFORMS_FILE",
    "AlignError",
    "AlignReport",
    "AlignTransforms",
    "align_checkpoint",
    "align_state",
    "load_align_transforms",
    "unalign_state",
    # theta types and the identity
    "FORMS",
    "FamilyTheta",
    "LayerTheta",
    "LowRankFamily",
    "SharedBasisFamily",
    "ThetaFamily",
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
    # the global budget
    "BUDGET_EXACT_MAX_DIM",
    "BudgetReport",
    "FamilyChoice",
    "FrontierPoint",
    "budget_frontier",
    "check_budget",
    "decompose_budget",
    "fit_budget",
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
    "basis_key",
    "copy_side_files",
    "decompose_checkpoint",
    "is_theta_checkpoint",
    "rebuild_dense_state",
    "save_theta",
    "shared_key",
    "theta_key",
    # integrity: every tensor's digest, recorded at write, checked at read
    "DIGESTS_FILE",
    "IntegrityReport",
    "check_checkpoint",
    "require_intact",
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
    # benchmark statistics (paired runs, ratio intervals, gate verdicts, machine load)
    "EXIT_CODES",
    "LoadReading",
    "MachineLoad",
    "Order",
    "PairedRuns",
    "RatioInterval",
    "gate_verdict",
    "machine_load",
    "paired_order",
    "paired_ratio",
    "read_load",
    "run_paired",
    "unpaired_ratio",
    # errors
    "AttnquantError",
    "BandMismatchError",
    "CheckpointError",
    "DecompositionError",
    "IntegrityError",
    "ThetaFormatError",
    "__version__",
]
