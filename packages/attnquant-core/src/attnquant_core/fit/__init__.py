"""Fitting theta bundles to weights: SVD, per-layer fits, the global budget, alignment, analysis.

* :func:`truncated_svd` (randomized range finder, exact for small matrices);
* :func:`gptq_nvfp4`: a 4-bit ``W0`` rounded for the output error (GPTQ) where statistics exist;
* :func:`fit_layer` and :func:`decompose_family` (banded fits of one family in memory),
  :func:`decompose_checkpoint` (a whole checkpoint, streamed, written as a theta checkpoint);
* the global budget: :func:`fit_budget`, :func:`decompose_budget`, :func:`budget_frontier`;
* :class:`DecomposeSpec`: the options of one decomposition with their defaults, checked once;
* function-preserving alignment of a family's layers: :func:`align_state`,
  :func:`align_checkpoint` and their inverse :func:`unalign_state`;
* error against compression: :func:`analyze_checkpoint`, :func:`sweep`.

Depends on :mod:`attnquant_core.forms` and :mod:`attnquant_core.io`.
"""

from ._align import align_checkpoint, align_state, unalign_state
from ._align_layout import ALIGN_MANIFEST_FILE, ALIGN_TRANSFORMS_FILE, AlignError
from ._align_transforms import AlignReport, AlignTransforms, aligned_record, load_align_transforms
from ._allocate import BudgetReport, FamilyChoice, check_budget
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
from ._budget import decompose_budget, fit_budget, resolve_allocation
from ._decompose import (
    DEFAULT_SVD,
    DecomposeProgress,
    LayerFit,
    SVDOptions,
    decompose_family,
    fit_layer,
    row_scale,
)
from ._frontier import FrontierPoint, budget_frontier
from ._gptq import ROUNDINGS, check_rounding, gptq_nvfp4
from ._output_analysis import OUTPUT_ERROR_DEFINITION, coverage_record
from ._spec import (
    ALLOCATIONS,
    DEFAULT_ALLOCATION,
    DEFAULT_BLOCKS,
    DEFAULT_QUANT_BLOCKS,
    DEFAULT_RANK,
    DEFAULT_ROUNDING,
    DEFAULT_SAMPLES,
    DEFAULT_SEQ_LEN,
    DEFAULT_SEQUENTIAL,
    DecomposeSpec,
    parse_budget,
)
from ._spectra import BUDGET_EXACT_MAX_DIM, DEFAULT_FORMS
from ._svd import EXACT_MAX_DIM, LowRank, randomized_svd, truncated_svd
from ._theta_checkpoint import decompose_checkpoint, rebuild_dense_state

__all__ = [
    # truncated SVD
    "EXACT_MAX_DIM",
    "LowRank",
    "randomized_svd",
    "truncated_svd",
    # per-layer and per-family fits
    "DEFAULT_SVD",
    "LayerFit",
    "SVDOptions",
    "decompose_family",
    "fit_layer",
    "row_scale",
    # a 4-bit W0 rounded for the output error
    "ROUNDINGS",
    "check_rounding",
    "gptq_nvfp4",
    # one decomposition's options and their defaults, checked once
    "ALLOCATIONS",
    "DEFAULT_ALLOCATION",
    "DEFAULT_BLOCKS",
    "DEFAULT_QUANT_BLOCKS",
    "DEFAULT_RANK",
    "DEFAULT_ROUNDING",
    "DEFAULT_SAMPLES",
    "DEFAULT_SEQUENTIAL",
    "DEFAULT_SEQ_LEN",
    "DecomposeSpec",
    "parse_budget",
    "resolve_allocation",
    # whole checkpoints
    "DecomposeProgress",
    "decompose_checkpoint",
    "rebuild_dense_state",
    # the global budget
    "BUDGET_EXACT_MAX_DIM",
    "DEFAULT_FORMS",
    "BudgetReport",
    "FamilyChoice",
    "FrontierPoint",
    "budget_frontier",
    "check_budget",
    "decompose_budget",
    "fit_budget",
    # function-preserving alignment
    "ALIGN_MANIFEST_FILE",
    "ALIGN_TRANSFORMS_FILE",
    "AlignError",
    "AlignReport",
    "AlignTransforms",
    "align_checkpoint",
    "align_state",
    "aligned_record",
    "load_align_transforms",
    "unalign_state",
    # error against compression
    "FamilyReport",
    "ModelReport",
    "SweepPoint",
    "SweepResult",
    "OUTPUT_ERROR_DEFINITION",
    "analyze_checkpoint",
    "coverage_record",
    "relative_error",
    "stored_parameters",
    "sweep",
]
