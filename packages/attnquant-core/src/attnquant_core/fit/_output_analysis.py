"""The output error beside the weight error, for ``analyze`` and the budget frontier.

Given calibration statistics (a projection's input gram ``G = sum x x^T``), a layer's
relative output error is ``||(W - W_hat) S||_F / ||W S||_F`` with ``S S^T = G + delta I``:
``sqrt(tr(E (G + delta I) E^T) / tr(W (G + delta I) W^T))``, ``E = W - W_hat``, the same
damped gram the whitened fits minimise (:mod:`attnquant_core.fit._whitened`; with
``damping=0`` it is exactly ``||(W - W_hat) X|| / ||W X||``). A family's and the model's
figure pool the layers' relative output errors by weight energy ``||W_l||^2``, the pooling of
the weight error, so the two are comparable figure for figure and the total is what the
budget allocator minimises.

Only families whose every layer has a gram get an output error; a family the statistics miss
(in whole or in part) has the weight error only, and :func:`coverage_record` says which.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import numpy as np

from .._errors import DecompositionError
from ..forms._banded import FamilyTheta
from ..forms._bands import band_of_layers, band_sizes, resolve_blocks
from ..forms._measure import FamilyErrors
from ..io._calibration import CalibrationStats
from ..io._checkpoint import Checkpoint, FamilyInfo
from ._decompose import DEFAULT_SVD, SVDOptions, band_mean, check_family_weights, check_rank
from ._decompose import fit_layer as _fit_layer
from ._whitened import Calibration, as_calibration, fit_layer_whitened

__all__ = [
    "OUTPUT_ERROR_DEFINITION",
    "Coverage",
    "coverage_record",
    "decompose_family_whitened",
    "family_coverage",
]

Coverage = Literal["full", "partial", "none"]

OUTPUT_ERROR_DEFINITION = (
    "per layer ||(W - W_hat) S|| / ||W S|| with S S^T = G + delta I (G the input gram of the "
    "statistics, delta = damping * mean(diag G)); pooled over layers by ||W||^2 like the weight "
    "error; of the fit made with the statistics (whitened, as decompose --calibration fits)"
)


def family_coverage(info: FamilyInfo, calibration: Calibration) -> Coverage:
    """Whether the statistics hold a gram for every, some or none of a family's layers."""
    have = sum(1 for k in info.keys if k in calibration.stats)
    return "full" if have == len(info.keys) else "none" if have == 0 else "partial"


def coverage_record(
    ckpt: Checkpoint, calibration: Calibration | CalibrationStats
) -> dict[str, object]:
    """What analyze writes of the statistics: file, tokens, damping and coverage per family.

    Raises :class:`DecompositionError` when no family is fully covered (no output error could
    be reported: the statistics are of another model, or hold other projections).
    """
    calibration = as_calibration(calibration)
    assert calibration is not None
    coverage = {n: family_coverage(info, calibration) for n, info in ckpt.families.items()}
    covered = [n for n, c in coverage.items() if c == "full"]
    if not covered:
        raise DecompositionError(
            f"{calibration.stats.path}: the statistics have no gram for every layer of any "
            f"projection family of this checkpoint (they hold {len(calibration.stats)} grams, "
            f"e.g. {calibration.stats.keys[:1]}); they are of another model"
        )
    without = [n for n, c in coverage.items() if c != "full"]
    return {
        "path": str(calibration.stats.path),
        "digest": calibration.stats.digest,
        "tokens": calibration.stats.tokens,
        "damping": calibration.damping,
        "output_error": OUTPUT_ERROR_DEFINITION,
        "families_with_statistics": covered,
        "families_weight_error_only": without,
        "partially_covered": [n for n, c in coverage.items() if c == "partial"],
        "note": (
            "every family has statistics"
            if not without
            else f"{len(without)} famil{'y' if len(without) == 1 else 'ies'} without "
            f"statistics for every layer ({', '.join(without)}): weight error only, left out "
            f"of the total output error"
        ),
    }


def pooled_over(errors: Mapping[str, float], norm2: Mapping[str, float]) -> float:
    """Relative error over some families from each one's relative error and squared norm."""
    den = sum(norm2[n] for n in errors)
    num = sum(e * e * norm2[n] for n, e in errors.items())
    return float(np.sqrt(num / den)) if den > 0 else 0.0


def decompose_family_whitened(
    weights: list[np.ndarray],
    info: FamilyInfo,
    calibration: Calibration,
    *,
    blocks: int | str,
    rank: int,
    name: str,
    svd: SVDOptions = DEFAULT_SVD,
) -> tuple[FamilyTheta, FamilyErrors, list[float] | None]:
    """:func:`decompose_family` fit for the output error where the statistics have a gram.

    Returns the theta, the weight errors of what was fitted, and the per-layer relative output
    errors (None unless every layer has a gram).
    """
    shape = check_family_weights(name, weights)
    dtype = np.dtype(weights[0].dtype)
    rank = check_rank(name, shape, rank)
    L = len(weights)
    G = resolve_blocks(blocks, L)
    white = calibration.getter(info.keys, shape[1])
    shared, layers, errors, norms, outputs = [], [], [], [], []
    start = 0
    for b, size in enumerate(band_sizes(L, G)):
        W0 = band_mean(weights[start : start + size], dtype)
        shared.append(W0)
        for layer in range(start, start + size):
            w = None  # the last layer's factor goes before this one's is made
            w = white(layer)
            args = dict(dtype=dtype, svd=svd, seed=(b, layer))
            if w is None:
                fit, out = _fit_layer(weights[layer], W0, rank, **args), None
            else:
                fit, out = fit_layer_whitened(weights[layer], W0, rank, w, **args)
            layers.append(fit.theta)
            errors.append(fit.error)
            norms.append(fit.norm)
            outputs.append(out)
        start += size
    theta = FamilyTheta(
        name=name, shared=tuple(shared), bands=tuple(band_of_layers(L, G)), layers=tuple(layers)
    )
    full = all(o is not None for o in outputs)
    return theta, FamilyErrors(errors, norms), [float(o) for o in outputs] if full else None
