"""NVFP4 rounding for the output error: GPTQ's column-by-column quantization of a 4-bit ``W0``.

Round-to-nearest (:func:`attnquant_core.quantize_nvfp4`, modelopt's rule) minimises each
weight's own error. With a projection's input gram ``H = sum x x^T`` (damped), GPTQ [1] instead
quantizes the inputs one column at a time and moves each column's rounding error onto the
columns not yet quantized, through the upper Cholesky factor ``U`` of ``H^{-1}``
(``H^{-1} = U^T U``), which greedily lowers ``||(W - Q) X||_F``. The NVFP4 layout is kept
exactly: the tensor scale is the weight's own (``amax / (6 * 448)``), and each 16-wide block's
E4M3 scale is taken, as in GPTQ's grouped quantization, from the block's values at the moment
it is reached (its error-compensated values), with the same float32 arithmetic and the same
E2M1 rounding as :func:`~attnquant_core.quantize_nvfp4`; anything it writes dequantizes with
:func:`~attnquant_core.dequantize_nvfp4`. With a diagonal ``H`` no error moves and the result is
byte-identical to round-to-nearest.

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
    "band_gram",
    "check_rounding",
    "gptq_nvfp4",
    "inverse_cholesky_upper",
    "rounding_fields",
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
    W: np.ndarray, gram: np.ndarray, *, name: str = "weight", batch: int = GPTQ_BATCH
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
    for i1 in range(0, in_dim, batch):
        i2 = min(i1 + batch, in_dim)
        block = work[:, i1:i2]  # a view: the updates below land in ``work``
        errors = np.zeros((out_dim, i2 - i1))
        for j in range(i2 - i1):
            col = i1 + j
            if col % BLOCK_SIZE == 0:
                # The block's scale from its current (error-compensated) values.
                e4m3, _ = _block_scales(block[:, j : j + BLOCK_SIZE].astype(np.float32), scale_2)
                scales[:, col // BLOCK_SIZE] = e4m3[:, 0]
                step = e4m3[:, 0].astype(np.float32) * scale_2
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
