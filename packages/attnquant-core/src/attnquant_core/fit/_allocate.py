"""Allocating a global budget over the candidate forms and ranks of every family (see
:mod:`attnquant_core.fit._budget`): greedy ranks per form, forms from a Lagrangian, then
improved one family at a time.

The currency is the spectra's: stored numbers, or stored bytes when a quantized ``W0`` is
among the candidates (:mod:`attnquant_core.fit._spectra_nvfp4`); every cost, the budget and
the dense size are then bytes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from .._errors import DecompositionError
from ..forms._bands import band_of_layers
from ..io._manifest import stored_of
from ._spectra import (
    Candidate,
    _check_forms,
    _Spectra,
)

__all__ = ["BudgetReport", "FamilyChoice", "allocate", "check_budget"]


def check_budget(budget: object) -> float:
    """``budget`` as a float in ``(0, 1]``, else an error naming it."""
    if isinstance(budget, bool) or not isinstance(budget, int | float | np.floating | np.integer):
        raise DecompositionError(f"budget must be a number in (0, 1], got {budget!r}")
    value = float(budget)
    if not (math.isfinite(value) and 0.0 < value <= 1.0):
        raise DecompositionError(
            f"budget={budget!r} is outside (0, 1]: it is stored over dense parameters of the "
            f"projections (0.5 keeps half; 1 or more would not compress)"
        )
    return value


@dataclass(frozen=True)
class FamilyChoice:
    """What the budget chose for one family, and why.

    ``error2`` is the squared Frobenius error predicted from the singular values; ``error`` is
    it relative to the family's norm. ``measured_error`` is the relative error of the fitted
    tensors (set once they are fitted). ``stored`` and ``dense`` count numbers (a quantized
    ``W0`` weight is one); a budget counted in bytes also sets ``stored_bytes`` (what the
    family's tensors take) and ``dense_bytes`` (the dense family at the source dtype), and
    ``quant`` names a quantized ``W0``.
    """

    name: str
    form: str
    blocks: int | None
    side: str | None
    ranks: tuple[int, ...]
    stored: int
    dense: int
    error2: float
    norm2: float
    why: str
    label: str
    measured_error: float | None = None
    quant: str | None = None
    stored_bytes: int | None = None
    dense_bytes: int | None = None
    candidate: Candidate | None = field(default=None, repr=False, compare=False)
    group_ranks: tuple[int, ...] = field(default=(), repr=False, compare=False)

    @property
    def error(self) -> float:
        return _relative(self.error2, self.norm2)

    def to_json(self) -> dict:
        in_bytes = (
            {}
            if self.stored_bytes is None
            else {
                "quant": self.quant,
                "stored_bytes": self.stored_bytes,
                "dense_bytes": self.dense_bytes,
            }
        )
        return {
            "form": self.form,
            "label": self.label,
            "blocks": self.blocks,
            "side": self.side,
            "ranks": list(self.ranks),
            "rank_min": min(self.ranks),
            "rank_max": max(self.ranks),
            "rank_mean": float(np.mean(self.ranks)),
            "stored_parameters": self.stored,
            "dense_parameters": self.dense,
            "predicted_error": self.error,
            "measured_error": self.measured_error,
            "why": self.why,
            **in_bytes,
        }


def _relative(error2: float, norm2: float) -> float:
    """The relative Frobenius error ``sqrt(error2 / norm2)`` of a squared error (0 for no norm)."""
    return math.sqrt(max(error2, 0.0) / norm2) if norm2 > 0 else 0.0


def _sum(choices: Mapping[str, FamilyChoice], attr: str):
    """The total of one field (``stored``, ``dense``, ``error2``) over the chosen families."""
    return sum(getattr(c, attr) for c in choices.values())


def _pooled(choices: Mapping[str, FamilyChoice], error2: Callable[[FamilyChoice], float]) -> float:
    """Relative error over every family: the families' squared errors over their squared norms."""
    return _relative(sum(error2(c) for c in choices.values()), _sum(choices, "norm2"))


def _total_error(choices: Mapping[str, FamilyChoice]) -> float:
    """The predicted relative error over every family (from the singular values)."""
    return _pooled(choices, lambda c: max(c.error2, 0.0))


@dataclass(frozen=True)
class BudgetReport:
    """The chosen decomposition at a budget, beside per-layer SVD with global ranks.

    ``families`` is what was chosen, ``baseline`` the low-rank-only allocation at the same
    budget; ``used_baseline`` says no mix of forms beat it, so the answer is the baseline.
    ``lam`` is the price per stored number (per byte when ``currency == "bytes"``) of the
    Lagrangian start. ``currency`` is what ``budget`` divides: ``"parameters"`` (stored over
    dense numbers) or ``"bytes"`` (stored over dense bytes, when a quantized ``W0`` competes).
    """

    budget: float
    lam: float
    families: dict[str, FamilyChoice]
    baseline: dict[str, FamilyChoice]
    used_baseline: bool
    manifest: dict | None = field(default=None, repr=False, compare=False)
    currency: str = "parameters"

    @property
    def stored(self) -> int:
        return _sum(self.families, "stored")

    @property
    def stored_bytes(self) -> int | None:
        """Bytes of every family's tensors (a budget counted in bytes; None otherwise)."""
        return None if self.currency != "bytes" else _sum(self.families, "stored_bytes")

    @property
    def dense_bytes(self) -> int | None:
        """Bytes of the dense projections at their source dtype (None unless counted in bytes)."""
        return None if self.currency != "bytes" else _sum(self.families, "dense_bytes")

    @property
    def dense(self) -> int:
        return _sum(self.families, "dense")

    @property
    def error(self) -> float:
        """Relative Frobenius error over every projection (predicted from singular values)."""
        return _total_error(self.families)

    @property
    def error2(self) -> float:
        return _sum(self.families, "error2")

    @property
    def measured_error(self) -> float | None:
        """Relative error over every projection of the fitted tensors, once fitted."""
        if any(c.measured_error is None for c in self.families.values()):
            return None
        return _pooled(self.families, lambda c: (c.measured_error or 0.0) ** 2 * c.norm2)

    @property
    def baseline_stored(self) -> int:
        return _sum(self.baseline, "stored")

    @property
    def baseline_error(self) -> float:
        return _total_error(self.baseline)

    @property
    def baseline_error2(self) -> float:
        return _sum(self.baseline, "error2")

    def to_json(self) -> dict:
        in_bytes = {}
        if self.currency == "bytes":
            assert self.stored_bytes is not None and self.dense_bytes is not None
            in_bytes = {
                "currency": "bytes",
                "stored_bytes": self.stored_bytes,
                "dense_bytes": self.dense_bytes,
                "bytes_over_dense": self.stored_bytes / self.dense_bytes,
            }
        return {
            "budget": self.budget,
            "lambda": self.lam,
            "stored_parameters": self.stored,
            "dense_parameters": self.dense,
            "stored_over_dense": self.stored / self.dense,
            **in_bytes,
            "predicted_error": self.error,
            "measured_error": self.measured_error,
            "used_baseline": self.used_baseline,
            "baseline": {
                "what": "per-layer truncated SVD with globally allocated ranks",
                "stored_parameters": self.baseline_stored,
                **(
                    {"stored_bytes": _sum(self.baseline, "stored_bytes")}
                    if self.currency == "bytes"
                    else {}
                ),
                "predicted_error": self.baseline_error,
                "families": {n: c.to_json() for n, c in self.baseline.items()},
            },
            "families": {n: c.to_json() for n, c in self.families.items()},
        }


def _greedy(
    assignment: Sequence[Candidate], budget_params: int
) -> tuple[float, list[np.ndarray]] | None:
    """Best ranks for a fixed form per family: units by drop per parameter, skipping misfits.

    Returns the total squared error and every family's group ranks, or None when the forms'
    fixed parameters alone exceed the budget. Within a group the units come in order, and a
    unit that does not fit means no later unit of its group fits (same cost), so the ranks are
    always prefixes of each group's spectrum.
    """
    left = budget_params - sum(c.fixed for c in assignment)
    if left < 0:
        return None
    ratio = np.concatenate([c.ratio for c in assignment])
    cost = np.concatenate([c.unit_cost_sorted for c in assignment])
    gain = np.concatenate([np.diff(c.cum_gain) for c in assignment])
    order = np.argsort(-ratio, kind="stable")
    useful = int(np.count_nonzero(ratio > 0.0))
    order = order[:useful]
    spent = np.cumsum(cost[order])
    n = int(np.searchsorted(spent, left, side="right"))
    take = np.zeros(len(ratio), bool)
    take[order[:n]] = True
    left -= int(spent[n - 1]) if n else 0
    rest = order[n:]
    while len(rest):  # the next unit, in order, that still fits; one numpy scan per unit taken
        fits = np.flatnonzero(cost[rest] <= left)
        if not len(fits):
            break
        i = rest[fits[0]]
        take[i] = True
        left -= int(cost[i])
        rest = rest[fits[0] + 1 :]
    err = sum(c.base for c in assignment) - float(np.sum(gain[take]))
    starts = np.cumsum([0] + [len(c.ratio) for c in assignment])
    ranks = [
        np.bincount(c.unit_group[take[starts[i] : starts[i + 1]]], minlength=len(c.gains))
        for i, c in enumerate(assignment)
    ]
    return err, ranks


def _lagrangian(
    options: Sequence[Sequence[Candidate]],
    budget_params: int,
    *,
    dense: int,
    currency: str = "parameters",
) -> tuple[float, list]:
    """The form per family at the least price ``lam`` whose Lagrangian optimum fits the budget.

    ``dense`` (the dense size in ``currency``) names the smallest feasible budget in the error
    raised when even the cheapest allowed forms do not fit.
    """

    def pick(lam: float) -> list[tuple[Candidate, int]]:
        chosen = []
        for opts in options:
            best = None
            for c in opts:
                n = c.taken(lam)
                err, cost = c.at(n)
                key = (err + lam * cost, cost)
                if best is None or key < best[0]:
                    best = (key, c, n)
            assert best is not None
            chosen.append((best[1], best[2]))
        return chosen

    def cost_of(chosen: list[tuple[Candidate, int]]) -> float:
        return sum(c.at(n)[1] for c, n in chosen)

    chosen = pick(0.0)
    if cost_of(chosen) <= budget_params:
        return 0.0, [c for c, _ in chosen]
    hi = 1.0
    for _ in range(400):
        if cost_of(pick(hi)) <= budget_params:
            break
        hi *= 4.0
    else:
        least = sum(min(c.fixed for c in opts) for opts in options)
        unit = "numbers" if currency == "parameters" else "bytes"
        smallest = math.ceil(least / dense * 1e4) / 1e4  # rounded up: it buys `least`
        raise DecompositionError(
            f"the budget buys {budget_params} {unit} but the forms allowed need at least "
            f"{int(least)}; raise the budget or allow the lowrank form (the smallest budget "
            f"these forms fit in is {smallest:g})"
        )
    lo = 0.0
    for _ in range(200):
        mid = hi / 2.0 if lo == 0.0 else math.sqrt(lo * hi)
        if mid <= lo or mid >= hi or (lo > 0.0 and hi / lo < 1.0 + 1e-12):
            break
        if cost_of(pick(mid)) <= budget_params:
            hi = mid
        else:
            lo = mid
    return hi, [c for c, _ in pick(hi)]


def _solve(
    spectra: Sequence[_Spectra], budget_params: int, forms: Sequence[str], *, quantized: bool = True
) -> tuple[float, list[tuple[Candidate, np.ndarray]]]:
    """Forms and ranks for every family: ``(lam, [(candidate, group ranks)])``.

    Starts from the Lagrangian choice of forms and from "low rank everywhere", improves each by
    switching one family's form at a time (ranks re-allocated greedily each time) while the
    total error falls, and keeps the better. The low-rank start is the baseline, so the answer
    is never worse than per-layer SVD with globally allocated ranks. Where quantized ``W0``
    candidates compete (``quantized=False`` leaves them out), the best answer of the float
    forms alone is a start too, so a 4-bit ``W0`` is only taken where it lowers the total.
    """
    options = [
        [c for c in s.candidates if c.form in forms and (quantized or c.quant is None)]
        for s in spectra
    ]
    for s, opts in zip(spectra, options, strict=True):
        if not opts:
            raise DecompositionError(f"{s.source.name}: no candidate form among {list(forms)}")
    dense = sum(s.dense_cost for s in spectra)
    currency = spectra[0].currency if spectra else "parameters"
    lam, start = _lagrangian(options, budget_params, dense=dense, currency=currency)
    starts = [start]
    lowrank = [next((c for c in opts if c.form == "lowrank"), None) for opts in options]
    if all(c is not None for c in lowrank) and lowrank != start:
        starts.append(lowrank)
    if quantized and any(c.quant is not None for opts in options for c in opts):
        try:
            floats = [c for c, _ in _solve(spectra, budget_params, forms, quantized=False)[1]]
        except DecompositionError:  # the float forms alone do not fit: nothing to start from
            floats = None
        if floats is not None and floats not in starts:
            starts.append(floats)
    best: tuple[float, list[Candidate], list[np.ndarray]] | None = None
    for assignment in starts:
        result = _greedy(assignment, budget_params)
        if result is None:
            continue
        err, ranks = result
        for _ in range(8):  # sweeps of one-family switches, while they help
            improved = False
            for f, opts in enumerate(options):
                for c in opts:
                    if c is assignment[f]:
                        continue
                    trial = [*assignment[:f], c, *assignment[f + 1 :]]
                    tried = _greedy(trial, budget_params)
                    if tried is not None and tried[0] < err - 1e-12 * abs(err):
                        assignment, (err, ranks), improved = trial, tried, True
            if not improved:
                break
        if best is None or err < best[0]:
            best = (err, assignment, ranks)
    assert best is not None
    return lam, list(zip(best[1], best[2], strict=True))


def _why(s: _Spectra, chosen: Candidate, stored: int, forms: Sequence[str]) -> str:
    """One line: what was chosen, and what the best other form and low rank give at its size
    (``stored`` in the spectra's currency)."""
    dense = s.dense_cost

    def rel(err: float) -> float:
        return _relative(err, s.norm2)

    parts = [f"{chosen.label} gives the least total error at this budget"]
    others = []
    for c in s.candidates:
        if c is chosen or c.form not in forms:
            continue
        err = c.best_within(stored)
        if err is not None:
            others.append((err, c))
    if others:
        others.sort(key=lambda t: t[0])
        lowrank = [t for t in others if t[1].form == "lowrank"]
        shown = [others[0], *[t for t in lowrank if t is not others[0]][:1]]
        parts.append(
            f"at the same size ({stored / dense:.3f} of dense) "
            + ", ".join(f"{c.label} gives err {rel(err):.4f}" for err, c in shown)
        )
    return "; ".join(parts)


def _choices(
    spectra: Sequence[_Spectra], budget: float, forms: Sequence[str]
) -> tuple[float, dict[str, FamilyChoice]]:
    dense = sum(s.dense_cost for s in spectra)
    lam, picked = _solve(spectra, math.floor(budget * dense), forms)
    out: dict[str, FamilyChoice] = {}
    for s, (c, group_ranks) in zip(spectra, picked, strict=True):
        L = s.source.num_layers
        taken = sum(float(np.sum(g[:k])) for g, k in zip(c.gains, group_ranks, strict=True))
        cost = c.fixed + int(np.dot(group_ranks, c.unit_cost))
        ranks = tuple(c.layer_ranks(group_ranks, L))
        stored, in_bytes = cost, {}
        if s.currency == "bytes":  # costs are bytes; count the numbers from the form
            bands = None if c.blocks is None else band_of_layers(L, c.blocks)
            stored = stored_of(c.form, s.source.shape, ranks, bands, c.side)
            in_bytes = {"stored_bytes": cost, "dense_bytes": s.dense_cost, "quant": c.quant}
        out[s.source.name] = FamilyChoice(
            name=s.source.name,
            form=c.form,
            blocks=c.blocks,
            side=c.side,
            ranks=ranks,
            stored=stored,
            dense=L * s.source.shape[0] * s.source.shape[1],
            error2=c.base - taken,
            norm2=s.norm2,
            why=_why(s, c, cost, forms),
            label=c.label,
            candidate=c,
            group_ranks=tuple(int(k) for k in group_ranks),
            **in_bytes,
        )
    return lam, out


def allocate(spectra: Sequence[_Spectra], budget: float, forms: Sequence[str]) -> BudgetReport:
    """Choose forms and ranks at ``budget``; never worse than per-layer SVD with global ranks."""
    budget = check_budget(budget)
    forms = _check_forms(forms)
    _, baseline = _choices(spectra, budget, ("lowrank",))
    lam, chosen = _choices(spectra, budget, forms)
    return BudgetReport(
        budget=budget,
        lam=lam,
        families=chosen,
        baseline=baseline,
        used_baseline=all(c.form == "lowrank" for c in chosen.values()),
        currency=spectra[0].currency if spectra else "parameters",
    )
