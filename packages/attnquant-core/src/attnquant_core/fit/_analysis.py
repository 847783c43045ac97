"""Error against compression: relative Frobenius errors, stored parameters, compression ratios."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import scipy.linalg

from ..forms._bands import band_sizes, group_blocks, resolve_blocks
from ..forms._identity import compute_dtype
from ..forms._measure import pooled_error
from ..forms._model import ThetaFamily
from ..io._checkpoint import Checkpoint, FamilyInfo, open_checkpoint
from ._decompose import DEFAULT_SVD, SVDOptions, band_mean, check_rank, decompose_family, row_scale
from ._svd import truncated_svd

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

    @property
    def error(self) -> float:
        """Relative Frobenius error over all layers of the family."""
        return pooled_error(self.layer_errors, self.layer_norms)

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

    def to_json(self) -> dict:
        return {
            "blocks": self.blocks,
            "rank": self.rank,
            "error": self.error,
            "stored_parameters": self.stored,
            "dense_parameters": self.dense,
            "compression": self.compression,
            "families": {
                n: {
                    "shape": list(f.shape),
                    "error": f.error,
                    "layer_errors": f.layer_errors,
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
) -> ModelReport:
    """Decompose every family in memory (one at a time) and report its error and size."""
    ckpt = ckpt if isinstance(ckpt, Checkpoint) else open_checkpoint(ckpt)
    reports: dict[str, FamilyReport] = {}
    G = resolve_blocks(blocks, ckpt.num_layers)
    for name, info in ckpt.families.items():
        weights = [ckpt.get(k, check_finite=True) for k in info.keys]
        theta, errs = decompose_family(
            weights, blocks=_blocks_of(info, G, ckpt.num_layers), rank=rank, name=name, svd=svd
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
        )
    return ModelReport(blocks=G, rank=rank, families=reports)


# -- sweeps: error against compression, theta beside per-layer SVD ---------------------------


@dataclass(frozen=True)
class SweepPoint:
    """One ``(G, r)`` point of a sweep for one family (or the total, ``family == "total"``).

    ``svd_rank`` and ``svd_error`` are plain per-layer truncated SVD at the largest rank whose
    stored parameters do not exceed the theta point's (``svd_stored``).
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
        }


@dataclass(frozen=True)
class SweepResult:
    """Every point of a ``G x r`` sweep, and the per-layer SVD curve over ranks."""

    points: list[SweepPoint]
    svd_curve: list[
        dict
    ]  # {"rank", "stored_parameters", "dense_parameters", "compression", "error"}

    def totals(self) -> list[SweepPoint]:
        return [p for p in self.points if p.family == "total"]


def _residual_energy(S: np.ndarray, norm2: float, r: int) -> float:
    """``||R - R_r||^2`` from the singular values of a rank-``r_max`` factorisation of ``R``."""
    return max(norm2 - float(np.sum(S[:r].astype(np.float64) ** 2)), 0.0)


def _blocks_of(info: FamilyInfo, blocks: int, num_layers: int) -> int:
    """A family's bands at the model-wide ``G`` (its group's share, for a grouped family)."""
    return blocks if info.group is None else group_blocks(blocks, info.num_layers, num_layers)


def sweep(
    ckpt: Checkpoint | str,
    *,
    blocks: list[int | str],
    ranks: list[int],
    svd: SVDOptions = DEFAULT_SVD,
    progress: Callable[[str], None] | None = None,
) -> SweepResult:
    """Error against stored size for every ``(G, r)``, with per-layer SVD at equal size beside it.

    For each family and ``G``, every layer's residual is factored once at the largest requested
    rank; the error at a smaller ``r`` follows from the leading singular values (the truncation
    is an orthogonal projection, so ``||R - R_r||^2 = ||R||^2 - sum_{i<r} S_i^2``). The per-layer
    SVD baseline uses exact singular values of every weight. Errors are in the compute dtype and
    leave out the rounding of storage in a lower precision.
    """
    ckpt = ckpt if isinstance(ckpt, Checkpoint) else open_checkpoint(ckpt)
    ranks = sorted(set(ranks))
    r_max = ranks[-1]
    L = ckpt.num_layers
    per_family: dict[str, list[SweepPoint]] = {}
    family_norm2: dict[str, float] = {}
    curve_parts: dict[str, list[tuple[int, int, float, float]]] = {}
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
        # Plain per-layer SVD: exact singular values of every weight, once, in float64 so the
        # tail energy near full rank is not lost to cancellation.
        sv = [scipy.linalg.svdvals(W.astype(np.float64), check_finite=False) for W in weights]
        full = min(out_dim, in_dim)

        def svd_error(k: int, sv=sv, norms2=norms2) -> float:
            return float(sum(_residual_energy(s, n2, k) for s, n2 in zip(sv, norms2, strict=True)))

        curve_parts[name] = [
            (L * k * (out_dim + in_dim), dense, svd_error(k), sum(norms2)) for k in range(full + 1)
        ]
        points: list[SweepPoint] = []
        for model_G in Gs:
            G = _blocks_of(info, model_G, ckpt.num_layers)
            if progress is not None:
                progress(f"{name} G={model_G}")
            energy = dict.fromkeys(ranks, 0.0)
            start = 0
            for b, size in enumerate(band_sizes(L, G)):
                W0 = band_mean(weights[start : start + size], cdt)
                for layer in range(start, start + size):
                    W = weights[layer]
                    s = row_scale(W, W0)
                    R = W - s[:, np.newaxis] * W0
                    n2 = float(np.sum(R.astype(np.float64) ** 2))
                    S = truncated_svd(
                        R,
                        r_max,
                        n_oversamples=svd.n_oversamples,
                        n_iter=svd.n_iter,
                        random_state=np.random.default_rng([svd.random_state, b, layer]),
                    ).S
                    for r in ranks:
                        energy[r] += _residual_energy(S, n2, r)
                start += size
            for r in ranks:
                stored = G * out_dim * in_dim + L * (out_dim + r * (out_dim + in_dim))
                k = min(stored // (L * (out_dim + in_dim)), full)
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
                        svd_error=float(np.sqrt(svd_error(k) / sum(norms2))),
                    )
                )
        per_family[name] = points
        del weights
    # Totals: pool squared errors (relative error times the family's norm) over families.
    all_points = [p for pts in per_family.values() for p in pts]
    totals = []
    for G in Gs:
        for r in ranks:
            pts = [p for p in all_points if p.blocks == G and p.rank == r]
            n2 = sum(family_norm2[p.family] for p in pts)

            def pooled(attr: str, pts=pts, n2=n2) -> float:
                return float(
                    np.sqrt(sum(getattr(p, attr) ** 2 * family_norm2[p.family] for p in pts) / n2)
                )

            totals.append(
                SweepPoint(
                    family="total",
                    blocks=G,
                    rank=r,
                    stored=sum(p.stored for p in pts),
                    dense=sum(p.dense for p in pts),
                    error=pooled("error"),
                    svd_rank=-1,  # differs per family
                    svd_stored=sum(p.svd_stored for p in pts),
                    svd_error=pooled("svd_error"),
                )
            )
    # The per-layer SVD curve of the whole model: one rank for every family, capped at full rank.
    curve = []
    for k in range(max(len(c) for c in curve_parts.values())):
        parts = [c[min(k, len(c) - 1)] for c in curve_parts.values()]  # capped at full rank
        stored, dense = sum(p[0] for p in parts), sum(p[1] for p in parts)
        curve.append(
            {
                "rank": k,
                "stored_parameters": stored,
                "dense_parameters": dense,
                "compression": dense / stored if stored else float("inf"),
                "error": float(np.sqrt(sum(p[2] for p in parts) / sum(p[3] for p in parts))),
            }
        )
    return SweepResult(points=all_points + totals, svd_curve=curve)
