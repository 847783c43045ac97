"""Spectra of every candidate form: what each rank unit of a family costs and what error it removes.

See :mod:`attnquant_core.fit._budget` for the method; singular values are exact up to
:data:`BUDGET_EXACT_MAX_DIM`, sketched above it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import scipy.linalg

from .._errors import DecompositionError
from ..forms._bands import band_of_layers, band_sizes
from ..forms._identity import compute_dtype
from ..forms._model import FORMS
from ..io._checkpoint import Checkpoint
from ._band_gains import band_residual_gains
from ._decompose import DecomposeProgress, SVDOptions
from ._svd import truncated_svd
from ._whiten import Whitening
from ._whitened import Calibration, scaled_whitening

__all__ = ["BUDGET_EXACT_MAX_DIM", "DEFAULT_FORMS", "Candidate"]


#: Largest side of a matrix (or of a shared basis's Gram) whose spectrum is computed exactly.
BUDGET_EXACT_MAX_DIM = 2048


_LOWRANK_SEED = 1_000_003


_SIDE_SEED = {"in": 2_000_003, "out": 2_000_004}


Getter = Callable[[int], np.ndarray]


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


@dataclass(frozen=True, eq=False)
class Candidate:
    """One way to store one family, with its exact error curve.

    ``fixed`` numbers are stored at rank 0 (``W0`` and ``s`` of a banded family), with squared
    error ``base``. Each group (a layer, or a band of a shared basis) then buys rank units at
    ``unit_cost[g]`` numbers each; its ``j``-th unit removes ``gains[g][j]`` (non-increasing).
    ``caps[g]`` is the rank its factorisation was taken at (to cut the same factors later).
    ``quant`` names how a banded family's ``W0`` is stored (``"nvfp4"``; None: in the storage
    dtype); a quantized candidate's costs are bytes (:mod:`attnquant_core.fit._spectra_nvfp4`).
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
    quant: str | None = None
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
            quant = "" if self.quant is None else f", W0 {self.quant}"
            return f"banded(G={self.blocks}{quant})"
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
    # Calibration: each layer's input whitening (None: that layer is fit unwhitened); see
    # attnquant_core.fit._whitened. Absent: every fit minimises the weight error.
    white: Callable[[int], Whitening | None] | None = None
    rounding: str = "gptq"  # a quantized W0's, where ``white`` covers its band (fit._gptq)

    def whitened_get(self, layer: int) -> np.ndarray:
        """``c W_l S_l`` (:func:`scaled_whitening`), or ``W_l`` where the layer has none."""
        white = self.white(layer) if self.white is not None else None
        W = self.get(layer)
        return W if white is None else scaled_whitening(W, white)[0]


@dataclass(frozen=True)
class _Spectra:
    """A family's candidates; their costs are stored numbers, or bytes when ``currency`` says so."""

    source: _Source
    norm2: float
    layer_norm2: tuple[float, ...]
    candidates: tuple[Candidate, ...]
    currency: str = "parameters"  # or "bytes" (a budget with a quantized W0)

    @property
    def dense_cost(self) -> int:
        """The dense family's size in the currency: ``L * out * in`` numbers, or their bytes
        at the source dtype."""
        out_dim, in_dim = self.source.shape
        numbers = self.source.num_layers * out_dim * in_dim
        return numbers if self.currency == "parameters" else numbers * self.source.dtype.itemsize


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
        W = np.asarray(src.whitened_get(layer), cdt)  # W itself when not calibrated
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
        # Calibrated: the output side only, whose basis is exact under each layer's own
        # whitening (the input side would need one whitening for the whole band).
        sides = ("in", "out") if src.white is None else ("out",)
        shared_src = src if src.white is None else replace(src, get=src.whitened_get, white=None)
        for side in sides if Gs else ():
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
            gains = _shared_gains(shared_src, side, plans, svd, exact)
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
            gains_b, base = band_residual_gains(
                src.get,
                src.white,
                L,
                src.store,
                G,
                lambda b, layers: _band_mean(src.get, layers, src.shape, src.dtype, src.store),
                lambda R, seed: _matrix_gains(R, layer_cap, svd, seed),
                seed=lambda b, layer, G=G: (G, b, layer),
            )
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


def _checkpoint_sources(
    ckpt: Checkpoint,
    dtype: np.dtype | type | None,
    calibration: Calibration | None = None,
    rounding: str = "gptq",
) -> list[_Source]:
    return [
        _Source(
            name,
            info.shape,
            info.num_layers,
            info.dtype,
            np.dtype(dtype) if dtype is not None else info.dtype,
            lambda layer, keys=info.keys: ckpt.get(keys[layer], check_finite=True),
            None if calibration is None else calibration.getter(info.keys, info.shape[1]),
            rounding,
        )
        for name, info in ckpt.families.items()
    ]
