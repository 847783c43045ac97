"""A global budget: choose every family's form and every layer's rank for the least total error.

The budget is stored parameters over dense parameters, summed over the projection families
(``s``, ``W0``, bases, ``U`` and ``V`` all count). The objective is the total squared Frobenius
error over every layer of every family. Because the error of a truncated SVD (or of projecting
onto a shared basis) is the energy its discarded singular values carry, every candidate form
has an exact error-against-rank curve before anything is fitted:

* ``lowrank``: the SVD of each ``W_l``; a rank unit of layer ``l`` costs ``out + in`` and
  removes ``sigma_j^2``.
* ``shared_basis`` side ``in`` with ``G`` bands: the SVD of the band's layers stacked
  vertically ``[W_1; ...; W_n]`` (its Gram ``sum W_l^T W_l``, ``[in, in]``); one basis column
  costs ``in + n * out``. Side ``out``: stacked horizontally (Gram ``sum W_l W_l^T``), a
  column costs ``out + n * in``. ``G = L`` is the low-rank form, so it is left out.
* ``banded`` with ``G`` bands: a fixed ``G * out * in + L * out`` (``W0`` and ``s``), then the
  SVD of each layer's residual ``W_l - diag(s_l) W0_b``, ``out + in`` per rank unit.

Allocation: for a fixed form per family, the best ranks are taken greedily, rank units in
order of error drop per parameter, skipping those that no longer fit (each group's drops are
non-increasing, so these are always prefixes of its spectrum). The forms come from a
Lagrangian: at a price ``lam`` per stored number each family takes the (form, ranks)
minimising ``error + lam * params``, and ``lam`` is bisected to meet the budget. Because the
forms make the problem non-convex, the forms are then improved by switching one family at a
time while the total error falls, starting both from the Lagrangian forms and from "low rank
everywhere", which is the baseline "per-layer SVD with globally allocated ranks" (the same
allocator restricted to ``lowrank``). The answer is thus never worse than that baseline.

Singular values are exact (LAPACK, in float64) when the matrix's smaller side, or the Gram's
side for a shared basis, is at most :data:`BUDGET_EXACT_MAX_DIM`; above that a randomized
truncated SVD (or a randomized subspace iteration on the Gram) is taken at a cap: the rank at
which the group would spend ``min(1, 2 * budget)`` of its own dense size, the most the budget
can sensibly buy there. Ranks above the cap are not considered. The fitted factors are cut
from the very factorisations the spectra came from, so the predicted error is the achieved one
up to the rounding of storage.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import scipy.linalg

from ._bands import band_of_layers, band_sizes
from ._checkpoint import Checkpoint, open_checkpoint
from ._decompose import SVDOptions, check_family_weights, fit_layer, pooled_error, residual
from ._errors import DecompositionError
from ._format import (
    DecomposeProgress,
    _copied_specs,
    _digest,
    _manifest,
    _plain_specs,
    _write_copied,
    _write_manifest,
    atomic_directory,
    basis_key,
    copy_side_files,
    family_entry,
    family_specs,
    shared_key,
    theta_key,
)
from ._forms import LowRankFamily, SharedBasisFamily
from ._safetensors_io import PlannedWriter, TensorSpec
from ._svd import compute_dtype, truncated_svd
from ._theta import FORMS, FamilyTheta, LayerTheta, ThetaFamily, ThetaModel

__all__ = [
    "BUDGET_EXACT_MAX_DIM",
    "BudgetReport",
    "FamilyChoice",
    "FrontierPoint",
    "budget_frontier",
    "check_budget",
    "decompose_budget",
    "fit_budget",
]

#: Largest side of a matrix (or of a shared basis's Gram) whose spectrum is computed exactly.
BUDGET_EXACT_MAX_DIM = 2048

_LOWRANK_SEED = 1_000_003
_SIDE_SEED = {"in": 2_000_003, "out": 2_000_004}

Getter = Callable[[int], np.ndarray]


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


def _check_forms(forms: Sequence[str]) -> tuple[str, ...]:
    forms = tuple(dict.fromkeys(forms))
    bad = [f for f in forms if f not in FORMS]
    if not forms or bad:
        raise DecompositionError(f"forms {list(forms)!r}: choose one or more of {', '.join(FORMS)}")
    return forms


def _blocks_set(given: Sequence[int] | None, default: Sequence[int], top: int) -> list[int]:
    if given is None:
        return sorted({int(G) for G in default if 1 <= G <= top})
    values = list(given)
    for G in values:
        if isinstance(G, bool) or not isinstance(G, int | np.integer) or G < 1:
            raise DecompositionError(f"blocks candidates must be whole numbers >= 1, got {G!r}")
    return sorted({int(g) for g in values if g <= top})


# -- spectra: every candidate's error-against-rank curve ---------------------------------------


@dataclass(frozen=True, eq=False)
class Candidate:
    """One way to store one family, with its exact error curve.

    ``fixed`` numbers are stored at rank 0 (``W0`` and ``s`` of a banded family), with squared
    error ``base``. Each group (a layer, or a band of a shared basis) then buys rank units at
    ``unit_cost[g]`` numbers each; its ``j``-th unit removes ``gains[g][j]`` (non-increasing).
    ``caps[g]`` is the rank its factorisation was taken at (to cut the same factors later).
    """

    family: str
    form: str
    blocks: int | None
    side: str | None
    fixed: int
    base: float
    unit_cost: np.ndarray
    gains: tuple[np.ndarray, ...]
    groups: tuple[tuple[int, ...], ...]
    caps: tuple[int, ...]
    # derived: every unit, best drop per parameter first
    ratio: np.ndarray = field(init=False, repr=False)
    unit_group: np.ndarray = field(init=False, repr=False)
    cum_gain: np.ndarray = field(init=False, repr=False)
    cum_cost: np.ndarray = field(init=False, repr=False)
    unit_cost_sorted: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        gains = [np.maximum(np.asarray(g, np.float64), 0.0) for g in self.gains]
        groups = np.concatenate(
            [np.full(len(g), i, np.int64) for i, g in enumerate(gains)] or [np.zeros(0, np.int64)]
        )
        gain = np.concatenate(gains or [np.zeros(0)])
        cost = self.unit_cost[groups].astype(np.float64) if len(groups) else np.zeros(0)
        ratio = gain / np.maximum(cost, 1.0)
        order = np.argsort(-ratio, kind="stable")  # stable: a group's units stay in order
        object.__setattr__(self, "gains", tuple(gains))
        object.__setattr__(self, "ratio", ratio[order])
        object.__setattr__(self, "unit_group", groups[order])
        object.__setattr__(self, "cum_gain", np.concatenate([[0.0], np.cumsum(gain[order])]))
        object.__setattr__(self, "cum_cost", np.concatenate([[0.0], np.cumsum(cost[order])]))
        object.__setattr__(self, "unit_cost_sorted", cost[order].astype(np.int64))

    @property
    def label(self) -> str:
        if self.form == "lowrank":
            return "lowrank"
        if self.form == "banded":
            return f"banded(G={self.blocks})"
        return f"shared_basis({self.side}, G={self.blocks})"

    def taken(self, lam: float) -> int:
        """How many units (best first) drop more than ``lam`` per parameter."""
        return int(np.searchsorted(-self.ratio, -lam, side="left"))

    def at(self, n: int) -> tuple[float, float]:
        """Squared error and stored numbers after the first ``n`` units."""
        return self.base - float(self.cum_gain[n]), self.fixed + float(self.cum_cost[n])

    def best_within(self, params: float) -> float | None:
        """Squared error of the best prefix of units that fits in ``params`` (None: never fits)."""
        if self.fixed > params:
            return None
        n = int(np.searchsorted(self.cum_cost, params - self.fixed, side="right")) - 1
        return self.at(n)[0]

    def group_ranks(self, n: int) -> np.ndarray:
        """Rank of every group after the first ``n`` units."""
        return np.bincount(self.unit_group[:n], minlength=len(self.gains))

    def layer_ranks(self, group_ranks: np.ndarray, num_layers: int) -> list[int]:
        ranks = [0] * num_layers
        for g, layers in enumerate(self.groups):
            for layer in layers:
                ranks[layer] = int(group_ranks[g])
        return ranks


@dataclass(frozen=True)
class _Source:
    """One family to allocate: how to read its layers, and what it is."""

    name: str
    shape: tuple[int, int]
    num_layers: int
    dtype: np.dtype  # source dtype
    store: np.dtype  # storage dtype
    get: Getter


@dataclass(frozen=True)
class _Spectra:
    source: _Source
    norm2: float
    layer_norm2: tuple[float, ...]
    candidates: tuple[Candidate, ...]


def _cap(full: int, group_dense: int, unit_cost: int, cap_budget: float) -> int:
    """The most rank units a group is offered in the randomized regime."""
    want = math.ceil(min(1.0, 2.0 * cap_budget) * group_dense / unit_cost)
    return max(1, min(full, want))


def _matrix_sketch(
    M: np.ndarray, cap: int, svd: SVDOptions, seed: Sequence[int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rank-``cap`` factorisation ``U @ V.T`` (``U`` absorbing ``S``) the allocator cuts from."""
    low = truncated_svd(
        M,
        cap,
        n_oversamples=svd.n_oversamples,
        n_iter=svd.n_iter,
        random_state=np.random.default_rng([svd.random_state, *seed]),
        exact_max_dim=BUDGET_EXACT_MAX_DIM,
    )
    return low.U, low.V, low.S


def _matrix_gains(M: np.ndarray, cap: int, svd: SVDOptions, seed: Sequence[int]) -> np.ndarray:
    """Squared singular values of ``M``: exact in float64 when small, else of the sketch."""
    if min(M.shape) <= BUDGET_EXACT_MAX_DIM:
        S = scipy.linalg.svdvals(np.asarray(M, np.float64), check_finite=False)
    else:
        S = _matrix_sketch(M, cap, svd, seed)[2].astype(np.float64)
    return S[:cap] ** 2


def _gram(W: np.ndarray, side: str) -> np.ndarray:
    W = np.asarray(W, np.float64)
    return W.T @ W if side == "in" else W @ W.T


def _band_basis(
    get: Getter,
    layers: Sequence[int],
    side: str,
    shape: tuple[int, int],
    cap: int,
    svd: SVDOptions,
    seed: Sequence[int],
    *,
    vectors: bool,
) -> tuple[np.ndarray, np.ndarray | None]:
    """The shared basis of one band: energies (descending) and, if asked, the basis ``[d, cap]``.

    Exact (eigen-decomposition of the float64 Gram) when the Gram's side is small; else a
    randomized subspace iteration on the Gram, streamed over the band's layers, with a
    Rayleigh-Ritz step: the Ritz values are exactly the energies the Ritz basis captures.
    """
    out_dim, in_dim = shape
    d = in_dim if side == "in" else out_dim
    if d <= BUDGET_EXACT_MAX_DIM:
        acc = np.zeros((d, d), np.float64)
        for layer in layers:
            acc += _gram(get(layer), side)
        if not vectors:
            evals = scipy.linalg.eigvalsh(acc, check_finite=False)[::-1]
            return np.maximum(evals[:cap], 0.0), None
        evals, evecs = scipy.linalg.eigh(acc, check_finite=False)
        evals, evecs = evals[::-1][:cap], evecs[:, ::-1][:, :cap]
        return np.maximum(evals, 0.0), evecs
    cdt = np.dtype(np.float32)
    size = min(cap + svd.n_oversamples, d)
    rng = np.random.default_rng([svd.random_state, *seed])
    Q = rng.standard_normal((d, size), dtype=cdt)

    def apply_gram(Q: np.ndarray) -> np.ndarray:
        Y = np.zeros_like(Q)
        for layer in layers:
            W = np.asarray(get(layer), cdt)
            Y += W.T @ (W @ Q) if side == "in" else W @ (W.T @ Q)
        return Y

    n_iter = 2 if svd.n_iter == "auto" else int(svd.n_iter)
    Q, _ = scipy.linalg.qr(Q, mode="economic", check_finite=False)
    for _ in range(n_iter):
        Q, _ = scipy.linalg.qr(apply_gram(Q), mode="economic", check_finite=False)
    T = Q.T.astype(np.float64) @ apply_gram(Q).astype(np.float64)
    evals, evecs = scipy.linalg.eigh((T + T.T) / 2, check_finite=False)
    evals, evecs = evals[::-1][:cap], evecs[:, ::-1][:, :cap]
    basis = Q.astype(np.float64) @ evecs if vectors else None
    return np.maximum(evals, 0.0), basis


def _band_mean(
    get: Getter, layers: Sequence[int], shape: tuple[int, int], src, store
) -> np.ndarray:
    """The band mean, accumulated one layer at a time, rounded to the storage dtype."""
    cdt = compute_dtype(np.result_type(src, store))
    acc = np.zeros(shape, cdt)
    for layer in layers:
        acc += get(layer)
    acc /= len(layers)
    return acc.astype(store)


def _shared_gains(
    src: _Source,
    side: str,
    plans: Mapping[int, tuple[list[int], list[int], list[int]]],
    svd: SVDOptions,
    exact: bool,
) -> dict[int, list[np.ndarray]]:
    """Energies of every band's shared basis, for every ``G`` of ``plans``, on one side.

    Exact: each layer's Gram is formed once and added to the open band of every ``G`` (bands
    are contiguous, so each ``G`` has one open band at a time). Randomized: band by band.
    """
    L = src.num_layers
    out: dict[int, list[np.ndarray]] = {G: [] for G in plans}
    if not exact:
        for G, (bands, _, caps) in plans.items():
            for b in range(G):
                layers = [i for i in range(L) if bands[i] == b]
                energies, _ = _band_basis(
                    src.get,
                    layers,
                    side,
                    src.shape,
                    caps[b],
                    svd,
                    (_SIDE_SEED[side], G, b),
                    vectors=False,
                )
                out[G].append(energies)
        return out
    open_: dict[int, np.ndarray | None] = dict.fromkeys(plans)
    for layer in range(L):
        gram = _gram(src.get(layer), side)
        for G, (bands, _, caps) in plans.items():
            acc = open_[G]
            open_[G] = gram.copy() if acc is None else acc + gram
            if layer == L - 1 or bands[layer + 1] != bands[layer]:  # the band closes
                evals = scipy.linalg.eigvalsh(open_[G], check_finite=False)[::-1]
                out[G].append(np.maximum(evals[: caps[bands[layer]]], 0.0))
                open_[G] = None
        del gram
    return out


def _spectra(
    src: _Source,
    *,
    forms: Sequence[str],
    banded_blocks: Sequence[int] | None,
    shared_blocks: Sequence[int] | None,
    cap_budget: float,
    svd: SVDOptions,
    progress: Callable[[DecomposeProgress], None] | None = None,
) -> _Spectra:
    """Every candidate form's error curve for one family (holds one layer, or Gram, at a time)."""
    name, (out_dim, in_dim), L = src.name, src.shape, src.num_layers
    full = min(out_dim, in_dim)
    dense_layer = out_dim * in_dim
    layer_cap = _cap(full, dense_layer, out_dim + in_dim, cap_budget)
    if full <= BUDGET_EXACT_MAX_DIM:
        layer_cap = full
    cdt = compute_dtype(np.result_type(src.dtype, src.store))
    layer_norm2: list[float] = []
    lowrank_gains: list[np.ndarray] = []
    for layer in range(L):
        W = np.asarray(src.get(layer), cdt)
        layer_norm2.append(float(np.sum(np.square(W, dtype=np.float64))))
        if "lowrank" in forms:
            lowrank_gains.append(_matrix_gains(W, layer_cap, svd, (_LOWRANK_SEED, layer)))
        if progress is not None:
            progress(DecomposeProgress(name, layer, L, float("nan"), stage="spectra"))
        del W
    norm2 = sum(layer_norm2)
    singles = tuple((layer,) for layer in range(L))
    candidates: list[Candidate] = []
    if "lowrank" in forms:
        candidates.append(
            Candidate(
                family=name,
                form="lowrank",
                blocks=None,
                side=None,
                fixed=0,
                base=norm2,
                unit_cost=np.full(L, out_dim + in_dim, np.int64),
                gains=tuple(lowrank_gains),
                groups=singles,
                caps=(layer_cap,) * L,
            )
        )
    if "shared_basis" in forms:
        Gs = _blocks_set(shared_blocks, (1, 2, 3, 4, L // 4, L // 2), L - 1)
        for side in ("in", "out") if Gs else ():
            d, other = (in_dim, out_dim) if side == "in" else (out_dim, in_dim)
            exact = d <= BUDGET_EXACT_MAX_DIM
            plans = {}
            for G in Gs:
                sizes = band_sizes(L, G)
                bands = band_of_layers(L, G)
                costs = [d + n * other for n in sizes]
                caps = [
                    min(d, n * other)
                    if exact
                    else _cap(min(d, n * other), n * dense_layer, cost, cap_budget)
                    for n, cost in zip(sizes, costs, strict=True)
                ]
                plans[G] = (bands, costs, caps)
            gains = _shared_gains(src, side, plans, svd, exact)
            for G, (bands, costs, caps) in plans.items():
                candidates.append(
                    Candidate(
                        family=name,
                        form="shared_basis",
                        blocks=G,
                        side=side,
                        fixed=0,
                        base=norm2,
                        unit_cost=np.asarray(costs, np.int64),
                        gains=tuple(gains[G]),
                        groups=tuple(tuple(i for i in range(L) if bands[i] == b) for b in range(G)),
                        caps=tuple(caps),
                    )
                )
    if "banded" in forms:
        for G in _blocks_set(banded_blocks, (1, 2, 4, L // 2), L):
            bands = band_of_layers(L, G)
            gains_b: list[np.ndarray] = []
            base = 0.0
            for b in range(G):
                layers = [i for i in range(L) if bands[i] == b]
                W0 = _band_mean(src.get, layers, src.shape, src.dtype, src.store)
                for layer in layers:
                    _, R = residual(src.get(layer), W0, src.store)
                    base += float(np.sum(np.square(R, dtype=np.float64)))
                    gains_b.append(_matrix_gains(R, layer_cap, svd, (G, b, layer)))
                    del R
            candidates.append(
                Candidate(
                    family=name,
                    form="banded",
                    blocks=G,
                    side=None,
                    fixed=G * dense_layer + L * out_dim,
                    base=base,
                    unit_cost=np.full(L, out_dim + in_dim, np.int64),
                    gains=tuple(gains_b),
                    groups=singles,
                    caps=(layer_cap,) * L,
                )
            )
    return _Spectra(src, norm2, tuple(layer_norm2), tuple(candidates))


# -- allocation --------------------------------------------------------------------------------


@dataclass(frozen=True)
class FamilyChoice:
    """What the budget chose for one family, and why.

    ``error2`` is the squared Frobenius error predicted from the singular values; ``error`` is
    it relative to the family's norm. ``measured_error`` is the relative error of the fitted
    tensors (set once they are fitted).
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
    candidate: Candidate | None = field(default=None, repr=False, compare=False)
    group_ranks: tuple[int, ...] = field(default=(), repr=False, compare=False)

    @property
    def error(self) -> float:
        return _relative(self.error2, self.norm2)

    def to_json(self) -> dict:
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
    ``lam`` is the price per stored number of the Lagrangian start.
    """

    budget: float
    lam: float
    families: dict[str, FamilyChoice]
    baseline: dict[str, FamilyChoice]
    used_baseline: bool
    manifest: dict | None = field(default=None, repr=False, compare=False)

    @property
    def stored(self) -> int:
        return _sum(self.families, "stored")

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
        return {
            "budget": self.budget,
            "lambda": self.lam,
            "stored_parameters": self.stored,
            "dense_parameters": self.dense,
            "stored_over_dense": self.stored / self.dense,
            "predicted_error": self.error,
            "measured_error": self.measured_error,
            "used_baseline": self.used_baseline,
            "baseline": {
                "what": "per-layer truncated SVD with globally allocated ranks",
                "stored_parameters": self.baseline_stored,
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


def _lagrangian(options: Sequence[Sequence[Candidate]], budget_params: int) -> tuple[float, list]:
    """The form per family at the least price ``lam`` whose Lagrangian optimum fits the budget."""

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
        raise DecompositionError(
            f"the budget buys {budget_params} numbers but the forms allowed need at least "
            f"{int(least)}; raise the budget or allow the lowrank form"
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
    spectra: Sequence[_Spectra], budget_params: int, forms: Sequence[str]
) -> tuple[float, list[tuple[Candidate, np.ndarray]]]:
    """Forms and ranks for every family: ``(lam, [(candidate, group ranks)])``.

    Starts from the Lagrangian choice of forms and from "low rank everywhere", improves each by
    switching one family's form at a time (ranks re-allocated greedily each time) while the
    total error falls, and keeps the better. The low-rank start is the baseline, so the answer
    is never worse than per-layer SVD with globally allocated ranks.
    """
    options = [[c for c in s.candidates if c.form in forms] for s in spectra]
    for s, opts in zip(spectra, options, strict=True):
        if not opts:
            raise DecompositionError(f"{s.source.name}: no candidate form among {list(forms)}")
    lam, start = _lagrangian(options, budget_params)
    starts = [start]
    lowrank = [next((c for c in opts if c.form == "lowrank"), None) for opts in options]
    if all(c is not None for c in lowrank) and lowrank != start:
        starts.append(lowrank)
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
    """One line: what was chosen, and what the best other form and low rank give at its size."""
    dense = s.source.num_layers * s.source.shape[0] * s.source.shape[1]

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
    dense = sum(s.source.num_layers * s.source.shape[0] * s.source.shape[1] for s in spectra)
    lam, picked = _solve(spectra, math.floor(budget * dense), forms)
    out: dict[str, FamilyChoice] = {}
    for s, (c, group_ranks) in zip(spectra, picked, strict=True):
        L = s.source.num_layers
        taken = sum(float(np.sum(g[:k])) for g, k in zip(c.gains, group_ranks, strict=True))
        stored = c.fixed + int(np.dot(group_ranks, c.unit_cost))
        out[s.source.name] = FamilyChoice(
            name=s.source.name,
            form=c.form,
            blocks=c.blocks,
            side=c.side,
            ranks=tuple(c.layer_ranks(group_ranks, L)),
            stored=stored,
            dense=L * s.source.shape[0] * s.source.shape[1],
            error2=c.base - taken,
            norm2=s.norm2,
            why=_why(s, c, stored, forms),
            label=c.label,
            candidate=c,
            group_ranks=tuple(int(k) for k in group_ranks),
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
    )


# -- fitting the chosen forms ------------------------------------------------------------------


def _fit_family(
    src: _Source,
    choice: FamilyChoice,
    *,
    stack: str,
    svd: SVDOptions,
    emit: Callable[[str, np.ndarray], None],
    progress: Callable[[DecomposeProgress], None] | None = None,
    digests: dict[int, str] | None = None,
) -> tuple[list[float], list[float]]:
    """Fit one family in its chosen form, one layer (or band) at a time; ``emit`` each tensor.

    Returns the per-layer relative errors and norms of what was stored.
    """
    c = choice.candidate
    assert c is not None
    name, L, store = src.name, src.num_layers, src.store
    cdt = compute_dtype(np.result_type(src.dtype, store))
    errors, norms = [0.0] * L, [0.0] * L

    def read(layer: int) -> np.ndarray:
        W = src.get(layer)
        if digests is not None and layer not in digests:
            digests[layer] = _digest(W)
        return W

    def done(layer: int, W: np.ndarray, W_eff: np.ndarray) -> None:
        Wc = np.asarray(W, cdt)
        norms[layer] = float(np.linalg.norm(Wc))
        diff = float(np.linalg.norm(Wc - W_eff))
        errors[layer] = diff / norms[layer] if norms[layer] > 0 else 0.0
        if progress is not None:
            progress(DecomposeProgress(name, layer, L, errors[layer]))

    if c.form == "lowrank":
        for layer in range(L):
            W = read(layer)
            r = choice.ranks[layer]
            if r:
                U, V, _ = _matrix_sketch(
                    np.asarray(W, cdt), c.caps[layer], svd, (_LOWRANK_SEED, layer)
                )
                U, V = U[:, :r].astype(store), V[:, :r].astype(store)
            else:
                U, V = np.zeros((src.shape[0], 0), store), np.zeros((src.shape[1], 0), store)
            emit(theta_key(stack, layer, name, "U"), U)
            emit(theta_key(stack, layer, name, "V"), V)
            done(layer, W, U.astype(cdt) @ V.astype(cdt).T)
    elif c.form == "banded":
        G = c.blocks
        assert G is not None
        bands = band_of_layers(L, G)
        for b in range(G):
            layers = [i for i in range(L) if bands[i] == b]
            W0 = _band_mean(read, layers, src.shape, src.dtype, store)
            emit(shared_key(name, b), W0)
            for layer in layers:
                W = read(layer)
                fit = fit_layer(
                    W,
                    W0,
                    choice.ranks[layer],
                    dtype=store,
                    svd=svd,
                    seed=(G, b, layer),
                    exact_max_dim=BUDGET_EXACT_MAX_DIM,
                    sketch_rank=c.caps[layer] if choice.ranks[layer] else None,
                )
                for part in ("s", "U", "V"):
                    emit(theta_key(stack, layer, name, part), getattr(fit.theta, part))
                norms[layer] = fit.norm
                errors[layer] = fit.error
                if progress is not None:
                    progress(DecomposeProgress(name, layer, L, fit.error))
    else:
        G, side = c.blocks, c.side
        assert G is not None and side is not None
        for b, layers in enumerate(c.groups):
            k = choice.group_ranks[b]
            d = src.shape[1] if side == "in" else src.shape[0]
            basis = np.zeros((d, 0))
            if k:
                basis = _band_basis(
                    read,
                    layers,
                    side,
                    src.shape,
                    c.caps[b],
                    svd,
                    (_SIDE_SEED[side], G, b),
                    vectors=True,
                )[1]
                assert basis is not None
            B = np.ascontiguousarray(basis[:, :k]).astype(store)
            emit(basis_key(name, b), B)
            Bc = B.astype(cdt)
            for layer in layers:
                W = read(layer)
                Wc = np.asarray(W, cdt)
                if side == "in":
                    coef = (Wc @ Bc).astype(store)  # U_l [out, k]
                    emit(theta_key(stack, layer, name, "U"), coef)
                    W_eff = coef.astype(cdt) @ Bc.T
                else:
                    coef = (Wc.T @ Bc).astype(store)  # V_l [in, k]
                    emit(theta_key(stack, layer, name, "V"), coef)
                    W_eff = Bc @ coef.astype(cdt).T
                done(layer, W, W_eff)
    return errors, norms


def _family_from(
    stack: str, choice: FamilyChoice, tensors: Mapping[str, np.ndarray], L: int
) -> ThetaFamily:
    name = choice.name
    key = theta_key
    if choice.form == "lowrank":
        return LowRankFamily(
            name=name,
            U=tuple(tensors[key(stack, i, name, "U")] for i in range(L)),
            V=tuple(tensors[key(stack, i, name, "V")] for i in range(L)),
        )
    assert choice.blocks is not None
    bands = band_of_layers(L, choice.blocks)
    if choice.form == "banded":
        return FamilyTheta(
            name=name,
            shared=tuple(tensors[shared_key(name, b)] for b in range(choice.blocks)),
            bands=tuple(bands),
            layers=tuple(
                LayerTheta(
                    s=tensors[key(stack, i, name, "s")],
                    U=tensors[key(stack, i, name, "U")],
                    V=tensors[key(stack, i, name, "V")],
                )
                for i in range(L)
            ),
        )
    part = "U" if choice.side == "in" else "V"
    return SharedBasisFamily(
        name=name,
        side=choice.side,  # type: ignore[arg-type]
        bases=tuple(tensors[basis_key(name, b)] for b in range(choice.blocks)),
        bands=tuple(bands),
        coefs=tuple(tensors[key(stack, i, name, part)] for i in range(L)),
    )


DEFAULT_FORMS: tuple[str, ...] = ("lowrank", "shared_basis", "banded")


def _spectra_all(
    sources: Sequence[_Spectra | _Source],
    *,
    forms: Sequence[str],
    banded_blocks: Sequence[int] | None,
    shared_blocks: Sequence[int] | None,
    cap_budget: float,
    svd: SVDOptions,
    progress: Callable[[DecomposeProgress], None] | None = None,
) -> list[_Spectra]:
    # The baseline needs the low-rank curves whatever forms are allowed.
    wanted = tuple(dict.fromkeys(("lowrank", *forms)))
    return [
        _spectra(
            s,  # type: ignore[arg-type]
            forms=wanted,
            banded_blocks=banded_blocks,
            shared_blocks=shared_blocks,
            cap_budget=cap_budget,
            svd=svd,
            progress=progress,
        )
        for s in sources
    ]


def fit_budget(
    families: Mapping[str, Sequence[np.ndarray]],
    budget: float,
    *,
    forms: Sequence[str] = DEFAULT_FORMS,
    banded_blocks: Sequence[int] | None = None,
    shared_blocks: Sequence[int] | None = None,
    dtype: np.dtype | type | None = None,
    svd: SVDOptions = SVDOptions(),
    stack: str = "model.layers",
) -> tuple[ThetaModel, BudgetReport]:
    """Choose forms and ranks at ``budget`` and fit them, in memory.

    Parameters
    ----------
    families : mapping of name to a sequence of ndarray (out, in)
        Every family's weights in layer order; every family has the same number of layers.
    budget : float in (0, 1]
        Stored parameters over dense parameters, over all the families.
    forms : sequence of str
        The forms a family may take (``lowrank``, ``shared_basis``, ``banded``).
    banded_blocks, shared_blocks : sequence of int, optional
        The ``G`` tried for banded and shared-basis families (defaults: ``1, 2, 4, L//2`` and
        ``1, 2, 3, 4, L//4, L//2``; shared bases at ``G = L`` are the low-rank form).
    dtype : dtype, optional
        Storage dtype; defaults to each family's weights' dtype.

    Returns
    -------
    model : ThetaModel
        The fitted families, each in its chosen form.
    report : BudgetReport
        What was chosen and why, predicted and measured errors, and the baseline.
    """
    budget = check_budget(budget)
    forms = _check_forms(forms)
    if not families:
        raise DecompositionError("fit_budget needs at least one family")
    sources: list[_Source] = []
    counts = set()
    for name, weights in families.items():
        weights = list(weights)
        shape = check_family_weights(name, weights)
        counts.add(len(weights))
        src_dtype = np.dtype(weights[0].dtype)
        sources.append(
            _Source(
                name,
                (int(shape[0]), int(shape[1])),
                len(weights),
                src_dtype,
                np.dtype(dtype) if dtype is not None else src_dtype,
                weights.__getitem__,
            )
        )
    if len(counts) != 1:
        raise DecompositionError(
            "every family needs the same number of layers; got "
            + ", ".join(f"{s.name}: {s.num_layers}" for s in sources)
        )
    spectra = _spectra_all(
        sources,
        forms=forms,
        banded_blocks=banded_blocks,
        shared_blocks=shared_blocks,
        cap_budget=budget,
        svd=svd,
    )
    report = allocate(spectra, budget, forms)
    fitted: dict[str, ThetaFamily] = {}
    choices: dict[str, FamilyChoice] = {}
    for s in spectra:
        choice = report.families[s.source.name]
        tensors: dict[str, np.ndarray] = {}
        errors, norms = _fit_family(
            s.source, choice, stack=stack, svd=svd, emit=tensors.__setitem__
        )
        fitted[s.source.name] = _family_from(stack, choice, tensors, s.source.num_layers)
        choices[s.source.name] = _with_measured(choice, errors, norms)
    model = ThetaModel(families=fitted, stack=stack)
    return model, _with_choices(report, choices)


def _with_measured(choice: FamilyChoice, errors: list[float], norms: list[float]) -> FamilyChoice:
    from dataclasses import replace

    return replace(choice, measured_error=pooled_error(errors, norms))


def _with_choices(report: BudgetReport, choices: dict[str, FamilyChoice], **kw) -> BudgetReport:
    from dataclasses import replace

    return replace(report, families=choices, **kw)


def _checkpoint_sources(ckpt: Checkpoint, dtype: np.dtype | type | None) -> list[_Source]:
    return [
        _Source(
            name,
            info.shape,
            info.num_layers,
            info.dtype,
            np.dtype(dtype) if dtype is not None else info.dtype,
            lambda layer, keys=info.keys: ckpt.get(keys[layer], check_finite=True),
        )
        for name, info in ckpt.families.items()
    ]


def decompose_budget(
    src: str | Path | Checkpoint,
    out: str | Path,
    *,
    budget: float,
    forms: Sequence[str] = DEFAULT_FORMS,
    banded_blocks: Sequence[int] | None = None,
    shared_blocks: Sequence[int] | None = None,
    dtype: np.dtype | type | None = None,
    svd: SVDOptions = SVDOptions(),
    progress: Callable[[DecomposeProgress], None] | None = None,
    max_shard_bytes: int = 2 << 30,
    overwrite: bool = False,
) -> BudgetReport:
    """Decompose a checkpoint at a global ``budget`` into a theta checkpoint (format v2) at ``out``.

    Two streamed passes, one family at a time: the spectra of every candidate form (one layer,
    band mean or Gram held at a time), then, after the allocation, the chosen form's tensors,
    written in place. ``attnquant.json`` says per family the form, bands, ranks, measured and
    predicted errors, stored parameters and why, and the budget's totals with the per-layer
    SVD baseline. Returns the :class:`BudgetReport` (its ``manifest`` is ``attnquant.json``).
    Nothing is left at ``out`` if anything fails.
    """
    budget = check_budget(budget)
    forms = _check_forms(forms)
    ckpt = src if isinstance(src, Checkpoint) else open_checkpoint(src)
    sources = _checkpoint_sources(ckpt, dtype)
    spectra = _spectra_all(
        sources,
        forms=forms,
        banded_blocks=banded_blocks,
        shared_blocks=shared_blocks,
        cap_budget=budget,
        svd=svd,
        progress=progress,
    )
    report = allocate(spectra, budget, forms)
    copied = _copied_specs(ckpt)
    specs: dict[str, TensorSpec] = dict(copied)
    for s in sources:
        c = report.families[s.name]
        specs.update(
            _plain_specs(
                family_specs(
                    s.name,
                    ckpt.stack,
                    form=c.form,
                    shape=s.shape,
                    dtype=s.store,
                    ranks=c.ranks,
                    bands=None if c.blocks is None else band_of_layers(s.num_layers, c.blocks),
                    side=c.side,
                )
            )
        )
    digests: dict[str, str] = {}
    families: dict[str, dict] = {}
    choices: dict[str, FamilyChoice] = {}
    with atomic_directory(Path(out), overwrite) as tmp:
        copy_side_files(ckpt.directory if ckpt.path.is_dir() else None, tmp)
        with PlannedWriter(tmp, specs, max_shard_bytes=max_shard_bytes) as writer:
            _write_copied(writer, ckpt, copied, digests)
            for s in sources:
                choice = report.families[s.name]
                layer_digests: dict[int, str] = {}
                errors, norms = _fit_family(
                    s,
                    choice,
                    stack=ckpt.stack,
                    svd=svd,
                    emit=writer.write,
                    progress=progress,
                    digests=layer_digests,
                )
                keys = ckpt.families[s.name].keys
                digests.update({keys[i]: d for i, d in layer_digests.items()})
                choice = _with_measured(choice, errors, norms)
                choices[s.name] = choice
                families[s.name] = family_entry(
                    form=choice.form,
                    shape=s.shape,
                    dtype=s.store,
                    source_dtype=s.dtype,
                    ranks=choice.ranks,
                    bands=None
                    if choice.blocks is None
                    else band_of_layers(s.num_layers, choice.blocks),
                    side=choice.side,
                    stored=choice.stored,
                    errors=errors,
                    norms=norms,
                    predicted_error=choice.error,
                    why=choice.why,
                )
        report = _with_choices(report, choices)
        summary = report.to_json()
        summary.pop("families")
        manifest = _manifest(
            num_layers=ckpt.num_layers,
            stack=ckpt.stack,
            families=families,
            svd=svd,
            source={"path": str(ckpt.path), "digests": digests},
            budget=summary,
        )
        _write_manifest(tmp, manifest)
    return _with_choices(report, choices, manifest=manifest)


# -- the budget frontier (analysis) ------------------------------------------------------------


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
    svd: SVDOptions = SVDOptions(),
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
