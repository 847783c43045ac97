"""The budget frontier: the error of the auto form and of per-layer SVD at many budgets, predicted
from one set of spectra (nothing is fitted).

With calibration statistics the frontier is the one ``decompose --budget --calibration``
follows (spectra of the whitened matrices) and its errors are relative output errors
(:mod:`attnquant_core.fit._output_analysis`), over the families with statistics.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .._errors import DecompositionError
from ..io._calibration import CalibrationStats
from ..io._checkpoint import Checkpoint, open_checkpoint
from ._allocate import (
    allocate,
    check_budget,
)
from ._decompose import DEFAULT_SVD, DecomposeProgress, SVDOptions
from ._output_analysis import coverage_record, family_coverage, pooled_over
from ._spectra import (
    DEFAULT_FORMS,
    _check_forms,
    _checkpoint_sources,
    _Spectra,
    _spectra_all,
)
from ._whitened import Calibration, as_calibration

__all__ = ["FrontierPoint", "budget_frontier", "frontier_point"]


@dataclass(frozen=True)
class FrontierPoint:
    """The auto form and per-layer SVD with global ranks at one budget (totals, predicted).

    ``objective`` is ``"weight"`` (errors are relative weight errors) or ``"output"`` (fit
    and allocated for the output error; errors are relative output errors, over the families
    in ``family_errors``, the others being without statistics).
    """

    budget: float
    stored: int
    dense: int
    error: float
    baseline_stored: int
    baseline_error: float
    used_baseline: bool
    forms: dict[str, str]
    family_errors: dict[str, float] = field(default_factory=dict)
    baseline_family_errors: dict[str, float] = field(default_factory=dict)
    objective: str = "weight"

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
            "objective": self.objective,
            "family_errors": self.family_errors,
            "lowrank_global_family_errors": self.baseline_family_errors,
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
    calibration: str | Path | CalibrationStats | Calibration | None = None,
) -> list[FrontierPoint]:
    """Total error of the auto form and of per-layer SVD with global ranks, at each budget.

    The spectra are computed once (at the largest budget's caps) and allocated at every budget;
    errors are predicted from singular values, nothing is fitted. With ``calibration`` the
    forms are fit and allocated for the output error (as ``decompose --budget --calibration``)
    and the points' errors are relative output errors over the families with statistics for
    every layer (``objective == "output"``).
    """
    budgets = [check_budget(b) for b in budgets]
    if not budgets:
        raise DecompositionError("budget_frontier needs at least one budget")
    forms = _check_forms(forms)
    ckpt = ckpt if isinstance(ckpt, Checkpoint) else open_checkpoint(ckpt)
    cal = as_calibration(calibration)
    covered = None
    if cal is not None:
        coverage_record(ckpt, cal)  # refuses statistics that cover no family
        covered = [n for n, i in ckpt.families.items() if family_coverage(i, cal) == "full"]
    spectra = _spectra_all(
        _checkpoint_sources(ckpt, None, cal),
        forms=forms,
        banded_blocks=banded_blocks,
        shared_blocks=shared_blocks,
        cap_budget=max(budgets),
        svd=svd,
        progress=progress,
    )
    return [frontier_point(spectra, b, forms, covered=covered) for b in budgets]


def frontier_point(
    spectra: Sequence[_Spectra],
    budget: float,
    forms: Sequence[str],
    *,
    covered: Sequence[str] | None = None,
) -> FrontierPoint:
    """Allocate at one budget and summarise.

    ``covered``: the spectra are whitened and these families have statistics for every layer;
    the point's errors are then their output errors (the others' would be weight errors).
    """
    report = allocate(spectra, budget, forms)
    names = list(report.families) if covered is None else list(covered)
    fam = {n: report.families[n].error for n in names}
    base = {n: report.baseline[n].error for n in names}
    norm2 = {n: report.families[n].norm2 for n in names}
    return FrontierPoint(
        budget=budget,
        stored=report.stored,
        dense=report.dense,
        error=report.error if covered is None else pooled_over(fam, norm2),
        baseline_stored=report.baseline_stored,
        baseline_error=report.baseline_error if covered is None else pooled_over(base, norm2),
        used_baseline=report.used_baseline,
        forms={n: c.label for n, c in report.families.items()},
        family_errors=fam,
        baseline_family_errors=base,
        objective="weight" if covered is None else "output",
    )
