"""The budget frontier: the error of the auto form and of per-layer SVD at many budgets, predicted
from one set of spectra (nothing is fitted).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .._errors import DecompositionError
from ..io._checkpoint import Checkpoint, open_checkpoint
from ._allocate import (
    allocate,
    check_budget,
)
from ._decompose import DEFAULT_SVD, DecomposeProgress, SVDOptions
from ._spectra import (
    DEFAULT_FORMS,
    _check_forms,
    _checkpoint_sources,
    _Spectra,
    _spectra_all,
)

__all__ = ["FrontierPoint", "budget_frontier", "frontier_point"]


@dataclass(frozen=True)
class FrontierPoint:
    """The auto form and per-layer SVD with global ranks at one budget (totals, predicted)."""

    budget: float
    stored: int
    dense: int
    error: float
    baseline_stored: int
    baseline_error: float
    used_baseline: bool
    forms: dict[str, str]

    @property
    def compression(self) -> float:
        return self.dense / self.stored if self.stored else float("inf")

    @property
    def baseline_compression(self) -> float:
        return self.dense / self.baseline_stored if self.baseline_stored else float("inf")

    def to_json(self) -> dict:
        return {
            "budget": self.budget,
            "stored_parameters": self.stored,
            "dense_parameters": self.dense,
            "compression": self.compression,
            "error": self.error,
            "lowrank_global_stored_parameters": self.baseline_stored,
            "lowrank_global_error": self.baseline_error,
            "used_baseline": self.used_baseline,
            "forms": self.forms,
        }


def budget_frontier(
    ckpt: Checkpoint | str | Path,
    budgets: Sequence[float],
    *,
    forms: Sequence[str] = DEFAULT_FORMS,
    banded_blocks: Sequence[int] | None = None,
    shared_blocks: Sequence[int] | None = None,
    svd: SVDOptions = DEFAULT_SVD,
    progress: Callable[[DecomposeProgress], None] | None = None,
) -> list[FrontierPoint]:
    """Total error of the auto form and of per-layer SVD with global ranks, at each budget.

    The spectra are computed once (at the largest budget's caps) and allocated at every budget;
    errors are predicted from singular values, nothing is fitted.
    """
    budgets = [check_budget(b) for b in budgets]
    if not budgets:
        raise DecompositionError("budget_frontier needs at least one budget")
    forms = _check_forms(forms)
    ckpt = ckpt if isinstance(ckpt, Checkpoint) else open_checkpoint(ckpt)
    spectra = _spectra_all(
        _checkpoint_sources(ckpt, None),
        forms=forms,
        banded_blocks=banded_blocks,
        shared_blocks=shared_blocks,
        cap_budget=max(budgets),
        svd=svd,
        progress=progress,
    )
    return [frontier_point(spectra, b, forms) for b in budgets]


def frontier_point(
    spectra: Sequence[_Spectra], budget: float, forms: Sequence[str]
) -> FrontierPoint:
    """Allocate at one budget and summarise."""
    report = allocate(spectra, budget, forms)
    return FrontierPoint(
        budget=budget,
        stored=report.stored,
        dense=report.dense,
        error=report.error,
        baseline_stored=report.baseline_stored,
        baseline_error=report.baseline_error,
        used_baseline=report.used_baseline,
        forms={n: c.label for n, c in report.families.items()},
    )
