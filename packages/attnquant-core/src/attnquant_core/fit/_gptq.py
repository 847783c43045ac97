"""NVFP4 rounding for the output error: GPTQ's column-by-column quantization of a 4-bit ``W0``.

Round-to-nearest (:func:`attnquant_core.quantize_nvfp4`, modelopt's rule) minimises each
weight's own error. With a projection's input gram ``H = sum x x^T`` (damped), GPTQ [1] instead
quantizes the inputs one column at a time and moves each column's rounding error onto the
columns not yet quantized, through the upper Cholesky factor ``U`` of ``H^{-1}``
(``H^{-1} = U^T U``), which greedily lowers ``||(W - Q) X||_F``. The NVFP4 layout is kept
exactly: the tensor scale is the weight's own (``amax / (6 * 448)``), and each 16-wide block's
E4M3 scale is chosen, as in GPTQ's grouped quantization, from the block's values at the moment
it is reached (its error-compensated values): by a search over a few scales at and below the
block's ``amax / 6`` for the least error weighted by each column's importance
(:func:`search_block_scales`; ``scale_search=False``: ``amax / 6`` alone), with the same
float32 arithmetic and the same E2M1 rounding as :func:`~attnquant_core.quantize_nvfp4`;
anything it writes dequantizes with :func:`~attnquant_core.dequantize_nvfp4`. With a diagonal
``H`` no error moves: without the search the result is byte-identical to round-to-nearest,
with it no block's weighted error exceeds round-to-nearest's.

References
----------
.. [1] Frantar, Ashkboos, Hoefler, Alistarh, "GPTQ: Accurate Post-Training Quantization for
   Generative Pre-trained Transformers", ICLR 2023.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import scipy.linalg

from .._errors import DecompositionError
from ..forms._nvfp4 import (
    _E4M3,
    BLOCK_SIZE,
    E2M1_VALUES,
    NVFP4Error,
    NVFP4Tensor,
    _as_float32_matrix,
    _block_scales,
    _tensor_scale,
    e2m1_codes,
    pack_nibbles,
)

__all__ = [
    "ROUNDINGS",
    "SCALE_FACTORS",
    "band_gram",
    "check_rounding",
    "gptq_nvfp4",
    "inverse_cholesky_upper",
    "rounding_fields",
    "search_block_scales",
]

#: How a quantized ``W0`` is rounded where statistics cover its band (``decompose --rounding``).
ROUNDINGS = ("gptq", "nearest")


def check_rounding(rounding: str) -> None:
    """Refuse an unknown ``rounding``."""
    if rounding not in ROUNDINGS:
        raise DecompositionError(
            f"rounding={rounding!r} is not a W0 rounding; choose one of {', '.join(ROUNDINGS)}"
        )


def rounding_fields(gptq_bands: int, bands: int) -> dict[str, str]:
    """A quantized family's manifest ``"rounding"``: ``"gptq"`` when every band's ``W0`` was
    rounded by GPTQ, ``"mixed"`` (GPTQ where statistics covered the band, nearest elsewhere)
    when some were; nothing when none (round to nearest, as always)."""
    if not gptq_bands:
        return {}
    return {"rounding": "gptq" if gptq_bands == bands else "mixed"}


class _HasGram(Protocol):
    def gram(self) -> np.ndarray: ...


#: Columns whose error moves onto the rest in one matrix product (a multiple of 16).
GPTQ_BATCH = 128

#: The block-scale candidates of the scale search, as multiples of round to nearest's
#: ``amax / 6`` before E4M3 rounding; 1.0 first, so a tie keeps round to nearest's scale.
SCALE_FACTORS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 1.05, 1.1)


def search_block_scales(block: np.ndarray, scale_2: np.float32, weights: np.ndarray) -> np.ndarray:
    """Each row's E4M3 scale for one 16-wide ``block`` ``[out, 16]`` (float32): of the E4M3
    roundings of ``amax / 6`` times each of :data:`SCALE_FACTORS`, the one whose E2M1 rounding
    has the least error weighted by the columns' ``weights`` ``[16]`` (a column's importance:
    GPTQ's ``1 / U[c, c]^2``, the gram's diagonal where no error moves), as llama.cpp's
    importance-weighted scale search and GPTQ's ``mse`` grid choose theirs. A smaller scale
    clips the largest weights to buy finer steps for the rest; the search takes it only where
    that lowers the weighted error, so no row-block's weighted error exceeds round to
    nearest's."""
    best = best_err = None
    for f in SCALE_FACTORS:
        e4m3 = _block_scales(block, scale_2, f)[0][:, 0]
        step = e4m3.astype(np.float32) * scale_2
        codes = e2m1_codes(block / step[:, None])
        q = E2M1_VALUES[codes] * step[:, None]
        err = ((block.astype(np.float64) - q) ** 2) @ weights
        if best is None:
            best, best_err = e4m3, err
        else:
            better = err < best_err
            best = np.where(better, e4m3, best)
            best_err = np.where(better, err, best_err)
    return best


def inverse_cholesky_upper(gram: np.ndarray, *, name: str = "gram") -> np.ndarray:
    """Upper triangular ``U`` with ``U^T U = gram^{-1}`` (float64), for a positive definite
    (already damped) ``gram``."""
    H = np.asarray(gram, dtype=np.float64)
    if H.ndim != 2 or H.shape[0] != H.shape[1]:
        raise NVFP4Error(f"{name}: a gram must be square; got shape {H.shape}")
    try:
        c = scipy.linalg.cho_factor(H, lower=True, check_finite=True)
        inverse = scipy.linalg.cho_solve(c, np.eye(H.shape[0]), check_finite=False)
        del c
        inverse = (inverse + inverse.T) / 2
        return scipy.linalg.cholesky(inverse, lower=False, overwrite_a=True, check_finite=False)
    except (np.linalg.LinAlgError, ValueError) as exc:
        raise NVFP4Error(f"{name}: not positive definite ({exc}); damp it first") from exc


def gptq_nvfp4(
    W: np.ndarray,
    gram: np.ndarray,
    *,
    name: str = "weight",
    batch: int = GPTQ_BATCH,
    scale_search: bool = True,
) -> NVFP4Tensor:
    """Quantize ``W`` ``[out, in]`` to NVFP4, choosing codes to lower ``||(W - Q) X||_F``.

    Parameters
    ----------
    W : ndarray, shape (out, in)
        Finite float weight; ``in`` a multiple of 16.
    gram : ndarray, shape (in, in)
        The damped input gram ``X X^T + delta I`` the error is weighed by (e.g.
        :meth:`attnquant_core.calib.Whitening.gram`), positive definite.
    batch : int, default=128
        Columns per lazy update (a multiple of 16); changes only the rounding of the updates.
    scale_search : bool, default=True
        Choose each block's E4M3 scale by :func:`search_block_scales` (the importance-weighted
        error over a few candidates) rather than from the block's largest value alone.

    Returns
    -------
    NVFP4Tensor
        The same layout :func:`~attnquant_core.quantize_nvfp4` writes.
    """
    W32 = _as_float32_matrix(W, name)
    out_dim, in_dim = W32.shape
    if np.shape(gram) != (in_dim, in_dim):
        raise NVFP4Error(f"{name}: gram has shape {np.shape(gram)}; expected {(in_dim, in_dim)}")
    if batch <= 0 or batch % BLOCK_SIZE:
        raise ValueError(f"batch must be a positive multiple of {BLOCK_SIZE}; got {batch}")
    U = inverse_cholesky_upper(gram, name=f"{name} gram")
    scale_2 = _tensor_scale(W32)
    work = W32.astype(np.float64)
    del W32
    codes = np.empty((out_dim, in_dim), np.uint8)
    scales = np.empty((out_dim, in_dim // BLOCK_SIZE), _E4M3)
    step = np.empty(out_dim, np.float32)
    importance = 1.0 / np.diag(U) ** 2  # each column's weight in the scale search
    for i1 in range(0, in_dim, batch):
        i2 = min(i1 + batch, in_dim)
        block = work[:, i1:i2]  # a view: the updates below land in ``work``
        errors = np.zeros((out_dim, i2 - i1))
        for j in range(i2 - i1):
            col = i1 + j
            if col % BLOCK_SIZE == 0:
                # The block's scale from its current (error-compensated) values.
                current = block[:, j : j + BLOCK_SIZE].astype(np.float32)
                if scale_search:
                    e4m3 = search_block_scales(current, scale_2, importance[col : col + BLOCK_SIZE])
                else:
                    e4m3 = _block_scales(current, scale_2)[0][:, 0]
                scales[:, col // BLOCK_SIZE] = e4m3
                step = e4m3.astype(np.float32) * scale_2
            c = e2m1_codes(block[:, j].astype(np.float32) / step)
            codes[:, col] = c
            err = (block[:, j] - (E2M1_VALUES[c] * step).astype(np.float64)) / U[col, col]
            block[:, j:] -= np.outer(err, U[col, i1 + j : i2])
            errors[:, j] = err
        if i2 < in_dim:
            work[:, i2:] -= errors @ U[i1:i2, i2:]
    return NVFP4Tensor(
        weight=pack_nibbles(codes),
        weight_scale=scales,
        weight_scale_2=np.asarray(scale_2, np.float32).reshape(()),
    )


def band_gram(
    white: Callable[[int], _HasGram | None] | None, layers: Sequence[int]
) -> np.ndarray | None:
    """The damped grams of a band's layers, summed (what its shared ``W0`` is weighed by in
    ``sum_l ||(W0 - Q) X_l||^2``); None unless every layer has statistics."""
    if white is None:
        return None
    total: np.ndarray | None = None
    for layer in layers:
        w = white(layer)
        if w is None:
            return None
        g = w.gram()
        del w
        if total is None:
            total = g
        else:
            total += g
        del g
    return total
