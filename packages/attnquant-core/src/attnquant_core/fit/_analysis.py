"""Error against compression: relative Frobenius errors, stored parameters, compression ratios."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import scipy.linalg

from ..forms._bands import band_sizes, group_blocks, resolve_blocks
from ..forms._identity import compute_dtype
from ..forms._measure import pooled_error
from ..forms._model import ThetaFamily
from ..io._calibration import CalibrationStats
from ..io._checkpoint import Checkpoint, FamilyInfo, open_checkpoint
from ._decompose import DEFAULT_SVD, SVDOptions, band_mean, check_rank, decompose_family, row_scale
from ._output_analysis import (
    coverage_record,
    decompose_family_whitened,
    family_coverage,
    pooled_over,
)
from ._svd import EXACT_MAX_DIM, truncated_svd
from ._whitened import Calibration, as_calibration, scaled_whitening, whitened_residual

__all__ = [
    "FamilyReport",
    "ModelReport",
    "SweepPoint",
    "SweepResult",
    "analyze_checkpoint",
    "sweep",
    "relative_error",
    "stored_parameters",
]


def relative_error(W: np.ndarray, W_eff: np.ndarray) -> float:
    """``||W - W_eff||_F / ||W||_F`` computed in float64 (0 for an all-zero ``W``)."""
    W = np.asarray(W, dtype=np.float64)
    norm = float(np.linalg.norm(W))
    diff = float(np.linalg.norm(W - np.asarray(W_eff, dtype=np.float64)))
    return diff / norm if norm > 0 else diff


def stored_parameters(theta: ThetaFamily) -> int:
    """Numbers a family stores, in any form (``W0``, bases once; ``s``, ``U``, ``V`` per layer)."""
    return theta.stored_parameters()


@dataclass(frozen=True)
class FamilyReport:
    """How well one family is rebuilt and what it costs to store."""

    name: str
    shape: tuple[int, int]
    blocks: int
    rank: int
    layer_errors: list[float]
    layer_norms: list[float]
    stored: int
    dense: int
    #: Per-layer relative output errors (``attnquant_core.fit._output_analysis``); None
    #: without statistics for every layer of the family.
    layer_output_errors: list[float] | None = None

    @property
    def error(self) -> float:
        """Relative Frobenius error over all layers of the family."""
        return pooled_error(self.layer_errors, self.layer_norms)

    @property
    def output_error(self) -> float | None:
        """Relative output error over all layers (weight-energy pooled), or None."""
        if self.layer_output_errors is None:
            return None
        return pooled_error(self.layer_output_errors, self.layer_norms)

    @property
    def compression(self) -> float:
        """Dense parameters over stored parameters (above 1 means smaller)."""
        return self.dense / self.stored


@dataclass(frozen=True)
class ModelReport:
    """Every family of one decomposition, with the totals over all of them."""

    blocks: int
    rank: int
    families: dict[str, FamilyReport] = field(default_factory=dict)
    #: What analyze records of the statistics (None: fitted for the weight error).
    calibration: dict | None = None

    @property
    def stored(self) -> int:
        return sum(f.stored for f in self.families.values())

    @property
    def dense(self) -> int:
        return sum(f.dense for f in self.families.values())

    @property
    def compression(self) -> float:
        return self.dense / self.stored

    @property
    def error(self) -> float:
        """Relative Frobenius error over every decomposed weight of the model."""
        errors = [e for f in self.families.values() for e in f.layer_errors]
        norms = [n for f in self.families.values() for n in f.layer_norms]
        return pooled_error(errors, norms)

    @property
    def output_error(self) -> float | None:
        """Relative output error over the families with statistics (None: without any)."""
        covered = [f for f in self.families.values() if f.layer_output_errors is not None]
        if not covered:
            return None
        errors = [e for f in covered for e in f.layer_output_errors or ()]
        return pooled_error(errors, [n for f in covered for n in f.layer_norms])

    def to_json(self) -> dict:
        return {
            "blocks": self.blocks,
            "rank": self.rank,
            "error": self.error,
            "output_error": self.output_error,
            "calibration": self.calibration,
            "stored_parameters": self.stored,
            "dense_parameters": self.dense,
            "compression": self.compression,
            "families": {
                n: {
                    "shape": list(f.shape),
                    "error": f.error,
                    "layer_errors": f.layer_errors,
                    "output_error": f.output_error,
                    "layer_output_errors": f.layer_output_errors,
                    "stored_parameters": f.stored,
                    "dense_parameters": f.dense,
                    "compression": f.compression,
                }
                for n, f in self.families.items()
            },
        }


def analyze_checkpoint(
    ckpt: Checkpoint | str,
    *,
    blocks: int | str = 1,
    rank: int = 16,
    svd: SVDOptions = DEFAULT_SVD,
    calibration: str | Path | CalibrationStats | Calibration | None = None,
) -> ModelReport:
    """Decompose every family in memory (one at a time) and report its error and size.

    With ``calibration`` (statistics, see :mod:`attnquant_core.calib`) every layer that has a
    gram is fit for the output error, as ``decompose --calibration`` fits it; the report then
    holds the relative output error of every family with statistics for all its layers beside
    the weight error (of the same, whitened, fit).
    """
    ckpt = ckpt if isinstance(ckpt, Checkpoint) else open_checkpoint(ckpt)
    cal = as_calibration(calibration)
    record = None if cal is None else coverage_record(ckpt, cal)
    reports: dict[str, FamilyReport] = {}
    G = resolve_blocks(blocks, ckpt.num_layers)
    for name, info in ckpt.families.items():
        weights = [ckpt.get(k, check_finite=True) for k in info.keys]
        family_G = _blocks_of(info, G, ckpt.num_layers)
        outputs = None
        if cal is None or family_coverage(info, cal) == "none":
            theta, errs = decompose_family(weights, blocks=family_G, rank=rank, name=name, svd=svd)
        else:
            theta, errs, outputs = decompose_family_whitened(
                weights, info, cal, blocks=family_G, rank=rank, name=name, svd=svd
            )
        del weights
        reports[name] = FamilyReport(
            name=name,
            shape=theta.shape,
            blocks=theta.blocks,
            rank=theta.rank,
            layer_errors=errs.errors,
            layer_norms=errs.norms,
            stored=theta.stored_parameters(),
            dense=theta.dense_parameters(),
            layer_output_errors=outputs,
        )
    return ModelReport(blocks=G, rank=rank, families=reports, calibration=record)


# -- sweeps: error against compression, theta beside per-layer SVD ---------------------------


@dataclass(frozen=True)
class SweepPoint:
    """One ``(G, r)`` point of a sweep for one family (or the total, ``family == "total"``).

    ``svd_rank`` and ``svd_error`` are plain per-layer truncated SVD at the largest rank whose
    stored parameters do not exceed the theta point's (``svd_stored``). With statistics,
    ``output_error`` and ``svd_output_error`` are the relative output errors of the same two
    forms fit for the output error (whitened), predicted from the whitened spectra
    (:mod:`attnquant_core.fit._output_analysis`); None for a family without statistics.
    """

    family: str
    blocks: int
    rank: int
    stored: int
    dense: int
    error: float
    svd_rank: int
    svd_stored: int
    svd_error: float
    output_error: float | None = None
    svd_output_error: float | None = None

    @property
    def compression(self) -> float:
        return self.dense / self.stored

    def to_json(self) -> dict:
        return {
            "family": self.family,
            "blocks": self.blocks,
            "rank": self.rank,
            "stored_parameters": self.stored,
            "dense_parameters": self.dense,
            "compression": self.compression,
            "error": self.error,
            "svd_rank": self.svd_rank,
            "svd_stored_parameters": self.svd_stored,
            "svd_error": self.svd_error,
            "output_error": self.output_error,
            "svd_output_error": self.svd_output_error,
        }


@dataclass(frozen=True)
class SweepResult:
    """Every point of a ``G x r`` sweep, and the per-layer SVD curve over ranks.

    Curve entries: ``{"rank", "stored_parameters", "dense_parameters", "compression",
    "error"}``; with statistics ``svd_output_curve`` is the whitened per-layer SVD's curve over
    the families with statistics (``"output_error"`` in place of ``"error"``) and
    ``calibration`` what was used (:func:`coverage_record`).
    """

    points: list[SweepPoint]
    svd_curve: list[dict]
    svd_output_curve: list[dict] = field(default_factory=list)
    calibration: dict | None = None

    def totals(self) -> list[SweepPoint]:
        return [p for p in self.points if p.family == "total"]


def _residual_energy(S: np.ndarray, norm2: float, r: int) -> float:
    """``||R - R_r||^2`` from the singular values of a rank-``r_max`` factorisation of ``R``."""
    return max(norm2 - float(np.sum(S[:r].astype(np.float64) ** 2)), 0.0)


def _blocks_of(info: FamilyInfo, blocks: int, num_layers: int) -> int:
    """A family's bands at the model-wide ``G`` (its group's share, for a grouped family)."""
    return blocks if info.group is None else group_blocks(blocks, info.num_layers, num_layers)


Residual = Callable[[int, np.ndarray, np.ndarray], np.ndarray]


def _band_energies(
    weights: list[np.ndarray],
    G: int,
    ranks: list[int],
    residual_of: Residual,
    svd: SVDOptions,
    *,
    values_only: bool = False,
) -> dict[int, float]:
    """Squared error of the banded fit at every rank, summed over layers, from one factorisation
    per layer at the largest rank (``residual_of(layer, W, W0)``: the matrix whose truncation
    error is the fit's error). ``values_only``: exact singular values alone (``svdvals``, no
    vectors) where the matrix is small enough for an exact SVD."""
    cdt = weights[0].dtype
    energy = dict.fromkeys(ranks, 0.0)
    start = 0
    for b, size in enumerate(band_sizes(len(weights), G)):
        W0 = band_mean(weights[start : start + size], cdt)
        for layer in range(start, start + size):
            R = residual_of(layer, weights[layer], W0)
            n2 = float(np.sum(R.astype(np.float64) ** 2))
            if values_only and min(R.shape) <= EXACT_MAX_DIM:
                S = scipy.linalg.svdvals(R, check_finite=False)[: ranks[-1]]
                for r in ranks:
                    energy[r] += _residual_energy(S, n2, r)
                continue
            S = truncated_svd(
                R,
                ranks[-1],
                n_oversamples=svd.n_oversamples,
                n_iter=svd.n_iter,
                random_state=np.random.default_rng([svd.random_state, b, layer]),
            ).S
            for r in ranks:
                energy[r] += _residual_energy(S, n2, r)
        start += size
    return energy


def _weight_residual(layer: int, W: np.ndarray, W0: np.ndarray) -> np.ndarray:
    return W - row_scale(W, W0)[:, np.newaxis] * W0


def sweep(
    ckpt: Checkpoint | str,
    *,
    blocks: list[int | str],
    ranks: list[int],
    svd: SVDOptions = DEFAULT_SVD,
    progress: Callable[[str], None] | None = None,
    calibration: str | Path | CalibrationStats | Calibration | None = None,
) -> SweepResult:
    """Error against stored size for every ``(G, r)``, with per-layer SVD at equal size beside it.

    For each family and ``G``, every layer's residual is factored once at the largest requested
    rank; the error at a smaller ``r`` follows from the leading singular values (the truncation
    is an orthogonal projection, so ``||R - R_r||^2 = ||R||^2 - sum_{i<r} S_i^2``). The per-layer
    SVD baseline uses exact singular values of every weight. Errors are in the compute dtype and
    leave out the rounding of storage in a lower precision.

    With ``calibration``, each family with statistics for every layer also gets the output
    error of the same forms fit for the output error, predicted the same way from the spectra
    of the whitened matrices ``c W S`` and ``c (W - diag(s) W0) S`` (``c = ||W|| / ||W S||``
    keeps the weight-energy pooling; ``s`` the whitened least-squares scale).
    """
    ckpt = ckpt if isinstance(ckpt, Checkpoint) else open_checkpoint(ckpt)
    cal = as_calibration(calibration)
    record = None if cal is None else coverage_record(ckpt, cal)
    ranks = sorted(set(ranks))
    r_max = ranks[-1]
    L = ckpt.num_layers
    per_family: dict[str, list[SweepPoint]] = {}
    family_norm2: dict[str, float] = {}
    curve_parts: dict[str, list[tuple[int, int, float, float]]] = {}
    output_parts: dict[str, list[tuple[int, int, float, float]]] = {}
    Gs = [resolve_blocks(b, L) for b in blocks]
    for name, info in ckpt.families.items():
        L = info.num_layers  # the family's layers (its group's, for a grouped family)
        out_dim, in_dim = info.shape
        check_rank(name, info.shape, r_max)
        cdt = compute_dtype(info.dtype)
        weights = [np.asarray(ckpt.get(k, check_finite=True), dtype=cdt) for k in info.keys]
        norms2 = [float(np.sum(W.astype(np.float64) ** 2)) for W in weights]
        family_norm2[name] = sum(norms2)
        dense = L * out_dim * in_dim
        full = min(out_dim, in_dim)
        # Plain per-layer SVD: exact singular values of every weight, once, in float64 so the
        # tail energy near full rank is not lost to cancellation.
        sv = [scipy.linalg.svdvals(W.astype(np.float64), check_finite=False) for W in weights]
        curve_parts[name] = _svd_curve(sv, norms2, dense, out_dim + in_dim, full)
        outputs = cal is not None and family_coverage(info, cal) == "full"
        if outputs:
            assert cal is not None
            white = cal.getter(info.keys, in_dim)
            if L * in_dim * in_dim * 8 <= 1 << 28:  # every G reuses the factors: keep them
                white = [white(i) for i in range(L)].__getitem__
            # The whitened per-layer SVD (SVD-LLM): singular values of c W S, exact, float64.
            sv_out = [
                scipy.linalg.svdvals(scaled_whitening(W, white(i))[0], check_finite=False)
                for i, W in enumerate(weights)
            ]
            output_parts[name] = _svd_curve(sv_out, norms2, dense, out_dim + in_dim, full)

            def output_residual(layer: int, W: np.ndarray, W0: np.ndarray, white=white):
                return whitened_residual(W, W0, white(layer), np.dtype(np.float64))

        points: list[SweepPoint] = []
        for model_G in Gs:
            G = _blocks_of(info, model_G, ckpt.num_layers)
            if progress is not None:
                progress(f"{name} G={model_G}")
            energy = _band_energies(weights, G, ranks, _weight_residual, svd)
            energy_out = (
                _band_energies(weights, G, ranks, output_residual, svd, values_only=True)
                if outputs
                else None
            )
            for r in ranks:
                stored = G * out_dim * in_dim + L * (out_dim + r * (out_dim + in_dim))
                k = min(stored // (L * (out_dim + in_dim)), full)
                out_error = svd_out_error = None
                if energy_out is not None:
                    out_error = float(np.sqrt(energy_out[r] / sum(norms2)))
                    svd_out_error = float(np.sqrt(output_parts[name][k][2] / sum(norms2)))
                points.append(
                    SweepPoint(
                        family=name,
                        blocks=model_G,
                        rank=r,
                        stored=stored,
                        dense=dense,
                        error=float(np.sqrt(energy[r] / sum(norms2))),
                        svd_rank=int(k),
                        svd_stored=L * int(k) * (out_dim + in_dim),
                        svd_error=float(np.sqrt(curve_parts[name][k][2] / sum(norms2))),
                        output_error=out_error,
                        svd_output_error=svd_out_error,
                    )
                )
        per_family[name] = points
        del weights
    all_points = [p for pts in per_family.values() for p in pts]
    return SweepResult(
        points=all_points + _totals(all_points, Gs, ranks, family_norm2),
        svd_curve=_model_curve(curve_parts, "error"),
        svd_output_curve=_model_curve(output_parts, "output_error") if output_parts else [],
        calibration=record,
    )


def _svd_curve(
    sv: list[np.ndarray], norms2: list[float], dense: int, unit: int, full: int
) -> list[tuple[int, int, float, float]]:
    """``(stored, dense, squared error, squared norm)`` of per-layer SVD at every rank."""
    L = len(sv)
    return [
        (
            L * k * unit,
            dense,
            float(sum(_residual_energy(s, n2, k) for s, n2 in zip(sv, norms2, strict=True))),
            sum(norms2),
        )
        for k in range(full + 1)
    ]


def _totals(
    points: list[SweepPoint], Gs: list[int], ranks: list[int], family_norm2: dict[str, float]
) -> list[SweepPoint]:
    """Pool squared errors (relative error times the family's norm) over families; output
    errors over the families that have them."""
    totals = []
    for G in Gs:
        for r in ranks:
            pts = [p for p in points if p.blocks == G and p.rank == r]

            def pooled(attr: str, pts=pts) -> float | None:
                have = {p.family: getattr(p, attr) for p in pts if getattr(p, attr) is not None}
                return pooled_over(have, family_norm2) if have else None

            totals.append(
                SweepPoint(
                    family="total",
                    blocks=G,
                    rank=r,
                    stored=sum(p.stored for p in pts),
                    dense=sum(p.dense for p in pts),
                    error=pooled("error") or 0.0,
                    svd_rank=-1,  # differs per family
                    svd_stored=sum(p.svd_stored for p in pts),
                    svd_error=pooled("svd_error") or 0.0,
                    output_error=pooled("output_error"),
                    svd_output_error=pooled("svd_output_error"),
                )
            )
    return totals


def _model_curve(parts: dict[str, list[tuple[int, int, float, float]]], what: str) -> list[dict]:
    """The per-layer SVD curve of the whole model: one rank for every family, capped at full
    rank."""
    curve = []
    for k in range(max(len(c) for c in parts.values())):
        rows = [c[min(k, len(c) - 1)] for c in parts.values()]
        stored, dense = sum(p[0] for p in rows), sum(p[1] for p in rows)
        curve.append(
            {
                "rank": k,
                "stored_parameters": stored,
                "dense_parameters": dense,
                "compression": dense / stored if stored else float("inf"),
                what: float(np.sqrt(sum(p[2] for p in rows) / sum(p[3] for p in rows))),
            }
        )
    return curve
