"""How far a fitted family is from the weights it stands for: per-layer errors, pooled."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["FamilyErrors", "pooled_error"]


def pooled_error(errors: Sequence[float], norms: Sequence[float]) -> float:
    """Relative Frobenius error of a set of layers from each layer's error and norm."""
    num = sum((e * n) ** 2 for e, n in zip(errors, norms, strict=True))
    den = sum(n**2 for n in norms)
    return float(np.sqrt(num / den)) if den > 0 else 0.0


@dataclass(frozen=True)
class FamilyErrors:
    """Per-layer relative errors and weight norms of one decomposed family."""

    errors: list[float]
    norms: list[float]

    @property
    def total(self) -> float:
        """The family's relative Frobenius error over all its layers."""
        return pooled_error(self.errors, self.norms)
