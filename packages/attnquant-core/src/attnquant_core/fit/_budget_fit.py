"""Fitting one family in the form a budget chose, one layer (or band) at a time.

The factors are cut from the very factorisations the budget's spectra came from (same
matrices, same seeds, same caps), so what is stored achieves the predicted error up to the
rounding of storage. See :mod:`attnquant_core.fit._budget`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from ..forms._banded import FamilyTheta, LayerTheta
from ..forms._bands import band_of_layers
from ..forms._factored import LowRankFamily, SharedBasisFamily
from ..forms._identity import compute_dtype
from ..forms._model import ThetaFamily
from ..forms._nvfp4 import NVFP4Tensor
from ..io._manifest import NVFP4_PARTS, basis_key, nvfp4_key, shared_key, theta_key
from ..io._manifest import theta_key as _theta_key
from ..io._theta_write import source_digest
from . import _spectra
from ._allocate import FamilyChoice
from ._decompose import DecomposeProgress, SVDOptions, fit_layer
from ._spectra import (
    _LOWRANK_SEED,
    _SIDE_SEED,
    _band_basis,
    _band_mean,
    _matrix_sketch,
    _Source,
)
from ._spectra_nvfp4 import NVFP4_SEED, nvfp4_band
from ._whiten import Whitening
from ._whitened import fit_layer_whitened, scaled_whitening

__all__ = ["family_from", "fit_family"]

# NVFP4Tensor's fields, in the order of NVFP4_PARTS (the keys' suffixes).
_NVFP4_FIELDS = ("weight", "weight_scale", "weight_scale_2")


def fit_family(
    src: _Source,
    choice: FamilyChoice,
    *,
    stack: str,
    svd: SVDOptions,
    emit: Callable[[str, np.ndarray], None],
    progress: Callable[[DecomposeProgress], None] | None = None,
    digests: dict[int, str] | None = None,
    layers: Sequence[int] | None = None,
    family: str | None = None,
) -> tuple[list[float], list[float]]:
    """Fit one family in its chosen form, one layer (or band) at a time; ``emit`` each tensor.

    ``layers`` and ``family`` place a grouped family's per-layer keys (its decoder layers and
    projection; default: layers ``0 .. L-1`` and ``src.name``). A banded choice with ``quant``
    stores each band's ``W0`` as its NVFP4 tensors and fits ``s``, ``U``, ``V`` against the
    dequantized block, from the same factorisations its spectra came from.
    Returns the per-layer relative errors and norms of what was stored.
    """
    c = choice.candidate
    assert c is not None
    name, L, store = src.name, src.num_layers, src.store
    at = list(range(L)) if layers is None else list(layers)

    def theta_key(stack: str, layer: int, name: str, part: str) -> str:
        return _theta_key(stack, at[layer], family or name, part)

    cdt = compute_dtype(np.result_type(src.dtype, store))
    errors, norms = [0.0] * L, [0.0] * L

    def read(layer: int) -> np.ndarray:
        W = src.get(layer)
        if digests is not None and layer not in digests:
            digests[layer] = source_digest(W)
        return W

    def done(layer: int, W: np.ndarray, W_eff: np.ndarray) -> None:
        Wc = np.asarray(W, cdt)
        norms[layer] = float(np.linalg.norm(Wc))
        diff = float(np.linalg.norm(Wc - W_eff))
        errors[layer] = diff / norms[layer] if norms[layer] > 0 else 0.0
        if progress is not None:
            progress(DecomposeProgress(name, layer, L, errors[layer]))

    def white(layer: int) -> Whitening | None:
        return src.white(layer) if src.white is not None else None

    if c.form == "lowrank":
        for layer in range(L):
            W = read(layer)
            r = choice.ranks[layer]
            w = None  # the last layer's factor goes before this one's is made
            w = white(layer)
            if r and w is not None:  # the SVD of c W S, cut where the spectra were taken
                M, scale = scaled_whitening(W, w)
                U, V, _ = _matrix_sketch(M.astype(cdt), c.caps[layer], svd, (_LOWRANK_SEED, layer))
                U = (U[:, :r] / scale).astype(store)
                V = w.unwhiten(np.asarray(V[:, :r], np.float64)).astype(store)
            elif r:
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
            if c.quant is None:
                W0 = _band_mean(read, layers, src.shape, src.dtype, store)
                emit(shared_key(name, b), W0)
            else:
                q, W0 = nvfp4_band(read, layers, src, b)
                parts = (q.weight, q.weight_scale, q.weight_scale_2)
                for part, array in zip(NVFP4_PARTS, parts, strict=True):
                    emit(nvfp4_key(name, b, part), array)
                del q
            for layer in layers:
                W = read(layer)
                w = None  # the last layer's factor goes before this one's is made
                w = white(layer)
                fit_args = dict(
                    dtype=store,
                    svd=svd,
                    seed=(G, b, layer) if c.quant is None else (NVFP4_SEED, G, b, layer),
                    exact_max_dim=_spectra.BUDGET_EXACT_MAX_DIM,  # read late: tests lower it
                    sketch_rank=c.caps[layer] if choice.ranks[layer] else None,
                )
                if w is None:
                    fit = fit_layer(W, W0, choice.ranks[layer], **fit_args)
                else:
                    fit, _ = fit_layer_whitened(W, W0, choice.ranks[layer], w, **fit_args)
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
                # Calibrated (output side only): the basis of the whitened layers; the
                # coefficients B^T W_l below are then exact under each layer's own whitening.
                basis = _band_basis(
                    read if src.white is None else src.whitened_get,
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


def family_from(
    stack: str, choice: FamilyChoice, tensors: Mapping[str, np.ndarray], L: int
) -> ThetaFamily:
    """The in-memory family of ``choice`` from the tensors :func:`fit_family` emitted."""
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
        layers = tuple(
            LayerTheta(
                s=tensors[key(stack, i, name, "s")],
                U=tensors[key(stack, i, name, "U")],
                V=tensors[key(stack, i, name, "V")],
            )
            for i in range(L)
        )
        if choice.quant is not None:
            nvfp4 = tuple(
                NVFP4Tensor(
                    **{
                        field: tensors[nvfp4_key(name, b, part)]
                        for field, part in zip(_NVFP4_FIELDS, NVFP4_PARTS, strict=True)
                    }
                )
                for b in range(choice.blocks)
            )
            return FamilyTheta.from_nvfp4(name=name, nvfp4=nvfp4, bands=tuple(bands), layers=layers)
        shared = tuple(tensors[shared_key(name, b)] for b in range(choice.blocks))
        return FamilyTheta(name=name, shared=shared, bands=tuple(bands), layers=layers)
    part = "U" if choice.side == "in" else "V"
    return SharedBasisFamily(
        name=name,
        side=choice.side,  # type: ignore[arg-type]
        bases=tuple(tensors[basis_key(name, b)] for b in range(choice.blocks)),
        bands=tuple(bands),
        coefs=tuple(tensors[key(stack, i, name, part)] for i in range(L)),
    )
