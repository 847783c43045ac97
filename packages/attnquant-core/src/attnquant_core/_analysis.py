"""Error against compression: relative Frobenius errors, stored parameters, compression ratios."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ._checkpoint import Checkpoint, open_checkpoint
from ._decompose import SVDOptions, decompose_family, pooled_error
from ._theta import FamilyTheta

__all__ = [
    "FamilyReport",
    "ModelReport",
    "analyze_checkpoint",
    "relative_error",
    "stored_parameters",
]


def relative_error(W: np.ndarray, W_eff: np.ndarray) -> float:
    """``||W - W_eff||_F / ||W||_F`` computed in float64 (0 for an all-zero ``W``)."""
    W = np.asarray(W, dtype=np.float64)
    norm = float(np.linalg.norm(W))
    diff = float(np.linalg.norm(W - np.asarray(W_eff, dtype=np.float64)))
    return diff / norm if norm > 0 else diff


def stored_parameters(theta: FamilyTheta) -> int:
    """Numbers a family stores: every ``W0`` once plus ``s``, ``U``, ``V`` per layer."""
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
    svd: SVDOptions = SVDOptions(),
) -> ModelReport:
    """Decompose every family in memory (one at a time) and report its error and size."""
    ckpt = ckpt if isinstance(ckpt, Checkpoint) else open_checkpoint(ckpt)
    reports: dict[str, FamilyReport] = {}
    G = 0
    for name, info in ckpt.families.items():
        weights = [ckpt.get(k, check_finite=True) for k in info.keys]
        theta, errs = decompose_family(weights, blocks=blocks, rank=rank, name=name, svd=svd)
        del weights
        G = theta.blocks
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
