"""Decomposition: band means, least-squares row scales, truncated SVD of the residual."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from .._errors import DecompositionError
from ..forms._banded import QUANTS, FamilyTheta, LayerTheta
from ..forms._bands import band_of_layers, band_sizes, resolve_blocks
from ..forms._identity import compute_dtype
from ..forms._measure import FamilyErrors
from ..forms._nvfp4 import BLOCK_SIZE, NVFP4Tensor, dequantize_nvfp4, quantize_nvfp4
from ._gptq import gptq_nvfp4
from ._svd import EXACT_MAX_DIM, truncated_svd

__all__ = [
    "DEFAULT_SVD",
    "DecomposeProgress",
    "LayerFit",
    "SVDOptions",
    "check_quant",
    "decompose_family",
    "fit_layer",
    "quantized_band",
    "row_scale",
]


@dataclass(frozen=True)
class DecomposeProgress:
    """One layer done, reported to the ``progress`` callback of :func:`decompose_checkpoint`.

    ``stage`` is ``"fit"`` when the layer's tensors were fitted (``error`` is its relative
    error), ``"spectra"`` when a budget decomposition measured its spectra (``error`` is NaN),
    ``"nvfp4"`` when a budget with ``quant="nvfp4"`` measured the spectrum of one quantized
    residual (``num_layers`` then counts them: every layer at every ``G`` tried).
    """

    family: str
    layer: int
    num_layers: int
    error: float
    stage: str = "fit"


@dataclass(frozen=True, kw_only=True)
class SVDOptions:
    """Settings of the truncated SVD (see :func:`attnquant_core.truncated_svd`)."""

    n_oversamples: int = 10
    n_iter: int | Literal["auto"] = "auto"
    random_state: int = 0

    def to_json(self) -> dict[str, object]:
        return {
            "n_oversamples": self.n_oversamples,
            "n_iter": self.n_iter,
            "random_state": self.random_state,
        }


#: The truncated SVD's default settings (the default of every ``svd=`` argument).
DEFAULT_SVD = SVDOptions()


@dataclass(frozen=True)
class LayerFit:
    """One layer fitted against its band's ``W0``: the stored tensors and the achieved error."""

    theta: LayerTheta
    error: float  # ||W - W_eff|| / ||W|| (Frobenius), W_eff rebuilt from the stored tensors
    norm: float  # ||W|| (Frobenius), to pool layer errors into a family error
    singular_values: np.ndarray


def row_scale(W: np.ndarray, W0: np.ndarray) -> np.ndarray:
    """Least-squares per-row scale ``s[o] = <W[o], W0[o]> / <W0[o], W0[o]>``, 0 for zero rows of ``W0``."""
    num = np.einsum("oi,oi->o", W, W0)
    den = np.einsum("oi,oi->o", W0, W0)
    s = np.zeros_like(den)
    np.divide(num, den, out=s, where=den > 0)
    return s


def check_rank(name: str, shape: tuple[int, int], rank: int) -> int:
    """``rank`` as an int within ``0..min(out, in)``, else an error naming the family."""
    if isinstance(rank, bool) or not isinstance(rank, int | np.integer) or rank < 0:
        raise DecompositionError(f"{name}: rank must be a non-negative int, got {rank!r}")
    if rank > min(shape):
        raise DecompositionError(
            f"{name}: rank={rank} exceeds min(out, in)={min(shape)} for weights of shape "
            f"{list(shape)}; choose rank <= {min(shape)}"
        )
    return int(rank)


def check_family_weights(name: str, weights: Sequence[np.ndarray]) -> tuple[int, ...]:
    """The shape every layer of a family shares, else an error naming the family and the layer.

    Refuses no layers, a layer that is not 2-D or not of layer 0's shape, and NaN/Inf values.
    """
    if not len(weights):
        raise DecompositionError(f"{name}: no weights to decompose")
    shape = weights[0].shape
    for i, W in enumerate(weights):
        if W.ndim != 2 or W.shape != shape:
            raise DecompositionError(
                f"{name}: shape mismatch inside the family: layer {i} is {list(W.shape)}, "
                f"layer 0 is {list(shape)}"
            )
        if not np.isfinite(W).all():
            raise DecompositionError(f"{name}: layer {i} holds NaN/Inf values")
    return shape


def residual(W: np.ndarray, W0: np.ndarray, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """The row scale ``s`` rounded to ``dtype`` and ``R = W - diag(s) W0`` in the compute dtype.

    ``W0`` is the stored (rounded) block, so ``R`` is exactly what the correction must carry.
    """
    cdt = compute_dtype(np.result_type(W.dtype, dtype))
    Wc = np.asarray(W, dtype=cdt)
    W0c = np.asarray(W0, dtype=cdt)
    s = row_scale(Wc, W0c).astype(dtype)
    R = s.astype(cdt)[:, np.newaxis] * W0c  # one [out, in] temporary: R = W - diag(s) W0
    np.subtract(Wc, R, out=R)
    return s, R


def fit_layer(
    W: np.ndarray,
    W0: np.ndarray,
    rank: int,
    *,
    dtype: np.dtype,
    svd: SVDOptions = SVDOptions(),
    seed: Sequence[int] = (),
    exact_max_dim: int = EXACT_MAX_DIM,
    sketch_rank: int | None = None,
) -> LayerFit:
    """Fit ``W ≈ diag(s) W0 + U V^T`` and round every stored tensor to ``dtype``.

    ``W0`` must already be the stored (rounded) shared block, so the residual is taken against
    exactly what a reader will rebuild from. Computes in float32 (float64 for float64 input).
    ``exact_max_dim`` is passed to :func:`truncated_svd`; ``sketch_rank`` (>= ``rank``), when
    given, factors the residual at that rank and keeps the leading ``rank`` triplets, so that
    every rank cut from one sketch shares its singular values (the budget allocator's spectra).
    """
    cdt = compute_dtype(np.result_type(W.dtype, dtype))
    s, R = residual(W, W0, dtype)
    low = truncated_svd(
        R,
        rank if sketch_rank is None else max(sketch_rank, rank),
        n_oversamples=svd.n_oversamples,
        n_iter=svd.n_iter,
        random_state=np.random.default_rng([svd.random_state, *seed]),
        exact_max_dim=exact_max_dim,
    )
    U, V = low.U[:, :rank].astype(dtype), low.V[:, :rank].astype(dtype)
    # The achieved error, from what is stored: R - U V^T is W - W_eff.
    if rank:
        R -= U.astype(cdt) @ V.astype(cdt).T
    norm = float(np.linalg.norm(np.asarray(W, dtype=cdt)))
    error = float(np.linalg.norm(R)) / norm if norm > 0 else 0.0
    return LayerFit(LayerTheta(s=s, U=U, V=V), error, norm, low.S[:rank])


def check_quant(name: str, shape: tuple[int, ...], quant: str | None) -> None:
    """Refuse an unknown ``quant`` or a family NVFP4 cannot hold (``in`` not a multiple of 16)."""
    if quant is None:
        return
    if quant not in QUANTS:
        raise DecompositionError(
            f"quant={quant!r} is not a W0 quantization; choose one of {', '.join(QUANTS)}"
        )
    if shape[1] % BLOCK_SIZE:
        raise DecompositionError(
            f"{name}: in={shape[1]} (weights {list(shape)}) is not a multiple of {BLOCK_SIZE}; "
            f"an NVFP4 W0 needs whole {BLOCK_SIZE}-input blocks"
        )


def quantized_band(
    mean: np.ndarray, name: str, gram: np.ndarray | None = None
) -> tuple[NVFP4Tensor, np.ndarray]:
    """A band's ``W0`` in NVFP4 and its float32 dequantization (what ``s``, ``U``, ``V`` fit).

    Round to nearest (modelopt's rule) without ``gram``; with the band's damped input gram,
    GPTQ's error-compensated rounding (:func:`~attnquant_core.fit._gptq.gptq_nvfp4`).
    """
    q = quantize_nvfp4(mean, name=name) if gram is None else gptq_nvfp4(mean, gram, name=name)
    return q, dequantize_nvfp4(q)


def band_mean(weights: Sequence[np.ndarray], dtype: np.dtype) -> np.ndarray:
    """Mean of a band's weights, accumulated in the compute dtype, rounded to ``dtype``."""
    cdt = compute_dtype(np.result_type(weights[0].dtype, dtype))
    acc = np.zeros(weights[0].shape, cdt)
    for W in weights:
        acc += W
    acc /= len(weights)
    return acc.astype(dtype)


def decompose_family(
    weights: Sequence[np.ndarray],
    *,
    blocks: int | str = 1,
    rank: int = 16,
    name: str = "family",
    dtype: np.dtype | type | None = None,
    svd: SVDOptions = SVDOptions(),
    quant: str | None = None,
) -> tuple[FamilyTheta, FamilyErrors]:
    """Decompose one family held in memory into a :class:`FamilyTheta`.

    Parameters
    ----------
    weights : sequence of ndarray of shape (out, in)
        The family's weights, one per layer, in layer order.
    blocks : int or "layers", default=1
        ``G``, the number of contiguous bands; "layers" is passthrough (``G = L``).
    rank : int, default=16
        Rank of the per-layer correction.
    dtype : dtype, optional
        Storage dtype of the bundle; defaults to the weights' dtype.
    quant : "nvfp4", optional
        Store each band's ``W0`` (the band mean, in float32) in NVFP4; ``s`` and the correction
        are fitted against its dequantization, so at passthrough the correction is the truncated
        SVD of the quantization error (LQER). Needs ``in`` a multiple of 16.

    Returns
    -------
    theta : FamilyTheta
    errors : FamilyErrors
        Per-layer relative Frobenius error of the rebuilt weight, and each weight's norm.
    """
    shape = check_family_weights(name, weights)
    dtype = np.dtype(dtype or weights[0].dtype)
    rank = check_rank(name, shape, rank)
    check_quant(name, shape, quant)
    G = resolve_blocks(blocks, len(weights))
    bands = band_of_layers(len(weights), G)
    shared, layers, errors, norms, packed = [], [], [], [], []
    start = 0
    for b, size in enumerate(band_sizes(len(weights), G)):
        if quant is None:
            W0 = band_mean(weights[start : start + size], dtype)
        else:
            mean = band_mean(weights[start : start + size], np.dtype(np.float32))
            q, W0 = quantized_band(mean, f"{name} band {b}")
            packed.append(q)
        shared.append(W0)
        for layer in range(start, start + size):
            fit = fit_layer(weights[layer], W0, rank, dtype=dtype, svd=svd, seed=(b, layer))
            layers.append(fit.theta)
            errors.append(fit.error)
            norms.append(fit.norm)
        start += size
    theta = FamilyTheta(
        name=name,
        shared=tuple(shared),
        bands=tuple(bands),
        layers=tuple(layers),
        nvfp4=tuple(packed) if quant is not None else None,
    )
    return theta, FamilyErrors(errors, norms)
