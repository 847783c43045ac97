"""Fitting for the output error: the whitened fits behind ``decompose --calibration``.

With a projection's input gram ``G = sum x x^T`` (:mod:`attnquant_core.calib`) and
``S S^T = G + delta I``, every fit minimises ``||(W - W_hat) S||_F`` (the error on the inputs
the projection really sees) instead of ``||W - W_hat||_F``:

* per-layer low rank: the truncated SVD of ``W S``, then ``V = S^{-T} V~`` (SVD-LLM);
* banded theta: ``W0`` the band mean as before, ``s`` by whitened least squares, the residual's
  truncated SVD whitened the same way;
* a shared basis on the output side: the band's basis from ``[W_1 S_1, ..., W_n S_n]``, each
  layer's coefficients ``B^T W_l`` (exact under each layer's own gram, Basis Sharing).

A projection the statistics do not cover is fit unwhitened. For the budget allocator, whose
objective sums squared errors over every layer of every family, each layer's whitened matrix
is scaled to carry its weight's energy (``c = ||W|| / ||W S||``): the split of the budget
between layers and families stays the weight-error one, while within a layer every rank unit
is spent where the inputs make it count.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..forms._banded import LayerTheta
from ..forms._identity import compute_dtype
from ..io._calibration import CalibrationStats, gram_key, read_stats
from ._decompose import DEFAULT_SVD, LayerFit, SVDOptions
from ._svd import EXACT_MAX_DIM, truncated_svd
from ._whiten import DEFAULT_DAMPING, Whitening, whitened_row_scale, whitening

__all__ = [
    "Calibration",
    "as_calibration",
    "fit_layer_whitened",
    "scaled_whitening",
    "whitened_residual",
]


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """Calibration statistics as the fits use them: a whitening per projection, on demand."""

    stats: CalibrationStats
    damping: float = DEFAULT_DAMPING
    #: Recorded over the statistics' own fields (e.g. the text a same-pass calibration read).
    data: Mapping[str, object] | None = None

    def whitening(self, key: str, in_features: int) -> Whitening | None:
        """The whitening of weight ``key``'s input, or None when the statistics lack it."""
        G = self.stats.gram(key, in_features=in_features)
        if G is None:
            return None
        return whitening(G, damping=self.damping, where=f"{self.stats.path}: {gram_key(key)!r}")

    def getter(self, keys: Sequence[str], in_features: int) -> Callable[[int], Whitening | None]:
        """``layer -> whitening`` for a family whose weight keys are ``keys``."""
        return lambda layer: self.whitening(keys[layer], in_features)

    def record(self, keys: Sequence[str]) -> dict[str, object]:
        """What the manifest says of the statistics used: digest, tokens, damping, coverage."""
        record: dict[str, object] = {
            "objective": "output error ||(W - W_hat) X|| over the calibration inputs (whitened "
            "fits; 'errors'/'error' stay the weight error, 'output_errors' and a budget's "
            "'predicted_error' are of the output)",
            "path": str(self.stats.path),
            "digest": self.stats.digest,
            "tokens": self.stats.tokens,
            "damping": self.damping,
            "whitened": sum(1 for k in keys if k in self.stats),
            "unwhitened": sum(1 for k in keys if k not in self.stats),
        }
        if self.data:
            record.update(self.data)
        return record


def as_calibration(
    calibration: str | Path | CalibrationStats | Calibration | None,
    damping: float = DEFAULT_DAMPING,
) -> Calibration | None:
    """A :class:`Calibration` from a path, opened statistics, or one already made."""
    if calibration is None or isinstance(calibration, Calibration):
        return calibration
    stats = calibration if isinstance(calibration, CalibrationStats) else read_stats(calibration)
    return Calibration(stats=stats, damping=damping)


def scaled_whitening(W: np.ndarray, white: Whitening) -> tuple[np.ndarray, float]:
    """``(c W S, c)`` with ``c = ||W|| / ||W S||``: the whitened matrix carrying ``W``'s energy."""
    M = white.whiten(W)
    norm_w = float(np.linalg.norm(np.asarray(W, np.float64)))
    norm_m = float(np.linalg.norm(M))
    c = norm_w / norm_m if norm_m > 0 else 1.0
    M *= c
    return M, c


def whitened_residual(
    W: np.ndarray, W0: np.ndarray, white: Whitening, store: np.dtype
) -> np.ndarray:
    """``c (W - diag(s) W0) S`` with ``s`` the whitened least-squares scale rounded to ``store``
    and ``c = ||W|| / ||W S||``: the banded residual the budget's spectra see."""
    Wd, W0d = np.asarray(W, np.float64), np.asarray(W0, np.float64)
    s = whitened_row_scale(Wd, W0d, white).astype(store).astype(np.float64)
    _, c = scaled_whitening(Wd, white)
    return c * white.whiten(Wd - s[:, None] * W0d)


def fit_layer_whitened(
    W: np.ndarray,
    W0: np.ndarray | None,
    rank: int,
    white: Whitening,
    *,
    dtype: np.dtype,
    svd: SVDOptions = DEFAULT_SVD,
    seed: Sequence[int] = (),
    exact_max_dim: int = EXACT_MAX_DIM,
    sketch_rank: int | None = None,
) -> tuple[LayerFit, float]:
    """:func:`fit_layer` for the output error; ``W0=None`` fits per-layer low rank (``s`` empty).

    Returns the fit (``error`` is the relative *weight* error of what is stored, as for
    :func:`fit_layer`, ``singular_values`` the whitened ones) and the relative output error
    ``||(W - W_eff) S|| / ||W S||``.
    """
    cdt = compute_dtype(np.result_type(W.dtype, dtype))
    Wd = np.asarray(W, np.float64)
    if W0 is None:
        s = np.zeros(Wd.shape[0], dtype)  # unused by the low-rank form
        R = Wd
    else:
        W0d = np.asarray(W0, np.float64)
        s = whitened_row_scale(Wd, W0d, white).astype(dtype)
        R = Wd - s.astype(np.float64)[:, None] * W0d
    Rw = white.whiten(R)
    low = truncated_svd(
        Rw.astype(cdt),
        rank if sketch_rank is None else max(sketch_rank, rank),
        n_oversamples=svd.n_oversamples,
        n_iter=svd.n_iter,
        random_state=np.random.default_rng([svd.random_state, *seed]),
        exact_max_dim=exact_max_dim,
    )
    U = low.U[:, :rank].astype(dtype)
    V = white.unwhiten(np.asarray(low.V[:, :rank], np.float64)).astype(dtype)
    diff = R - U.astype(np.float64) @ V.astype(np.float64).T if rank else R
    norm = float(np.linalg.norm(Wd))
    error = float(np.linalg.norm(diff)) / norm if norm > 0 else 0.0
    out_norm = float(np.linalg.norm(white.whiten(Wd)))
    out_error = float(np.linalg.norm(white.whiten(diff))) / out_norm if out_norm > 0 else 0.0
    return LayerFit(LayerTheta(s=s, U=U, V=V), error, norm, low.S[:rank]), out_error
