"""Whitened fitting: minimise the output error ``||(W - W_hat) X||_F`` instead of ``||W - W_hat||_F``.

With ``G = X X^T`` (the projection's input gram) and any ``S`` with ``S S^T = G``,
``||(W - W_hat) X||_F^2 = tr((W - W_hat) G (W - W_hat)^T) = ||(W - W_hat) S||_F^2``, so each
fit is the ordinary one applied to ``W S`` and mapped back by ``S^{-1}`` (SVD-LLM [1]; Basis
Sharing [2] for the shared bases). ``S`` is the Cholesky factor of the damped gram
``G + delta I`` (``delta = damping * mean(diag G)``): the damping keeps directions the
calibration never excited from being fit arbitrarily and makes ``S`` invertible. Where
Cholesky fails numerically (a rank-deficient ``G`` and a tiny damping), ``S = Q sqrt(max(w, 0)
+ delta)`` from the eigendecomposition ``G = Q w Q^T``; an eigenvalue below ``-delta`` means
the gram is not positive semi-definite and is refused.

Everything is computed in float64.

References
----------
.. [1] Wang, Zheng, Zhang, Zhang, "SVD-LLM: Truncation-aware Singular Value Decomposition for
   Large Language Model Compression", ICLR 2025.
.. [2] Wang, Zheng, Zhang, Zhang, "Basis Sharing: Cross-Layer Parameter Sharing for Large
   Language Model Compression", ICLR 2025.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import scipy.linalg

from ..io._calibration import CalibrationError, _row_blocks

__all__ = [
    "DEFAULT_DAMPING",
    "Whitening",
    "output_error",
    "whitened_residual_svd",
    "whitened_row_scale",
    "whitened_shared_basis",
    "whitened_spectrum",
    "whitened_svd",
    "whitening",
]

#: Damping relative to the mean diagonal of the gram (GPTQ's ``percdamp`` convention).
DEFAULT_DAMPING = 1e-2


@dataclass(frozen=True, kw_only=True)
class Whitening:
    """A factor ``S`` with ``S S^T = G + delta I``.

    ``factor`` is lower triangular (Cholesky) when ``eigen`` is None; otherwise
    ``factor = Q diag(eigen)`` with ``Q`` (``basis``) orthogonal and ``eigen >= 0``; a zero
    ``eigen`` (no damping, a direction no token excited) is inverted as zero (pseudo-inverse).

    ``error_weight``: what a unit of this projection's squared output error weighs in a budget's
    allocation (:func:`~attnquant_core.fit._whitened.scaled_whitening`; None: its weight's
    energy over its output energy, the ``global`` allocation).
    """

    factor: np.ndarray
    delta: float
    eigen: np.ndarray | None = None
    basis: np.ndarray | None = None
    error_weight: float | None = None

    @property
    def width(self) -> int:
        return self.factor.shape[0]

    def whiten(self, W: np.ndarray) -> np.ndarray:
        """``W S`` (``W`` is ``[out, in]``)."""
        return np.asarray(W, dtype=np.float64) @ self.factor

    def unwhiten(self, V: np.ndarray) -> np.ndarray:
        """``S^{-T} V`` (``V`` is ``[in, r]``): maps right factors of ``W S`` back to ``W``'s input."""
        V = np.asarray(V, dtype=np.float64)
        if self.eigen is None:
            return scipy.linalg.solve_triangular(self.factor, V, trans="T", lower=True)
        assert self.basis is not None
        tiny = np.finfo(np.float64).eps * max(float(self.eigen.max()), 1e-300) * self.width
        inv = np.where(self.eigen > tiny, 1.0 / np.maximum(self.eigen, tiny), 0.0)
        return self.basis @ (inv[:, None] * V)

    def gram(self) -> np.ndarray:
        """The damped gram ``S S^T`` the fit actually weighs by."""
        return self.factor @ self.factor.T


def _has_negative_zero(G: np.ndarray) -> bool:
    """Whether ``G`` holds a ``-0.0`` (a block of rows at a time)."""
    for i, j in _row_blocks(G.shape[0]):
        block = G[i:j]
        if np.any(np.signbit(block) & (block == 0)):
            return True
    return False


def whitening(
    G: np.ndarray,
    *,
    damping: float = DEFAULT_DAMPING,
    where: str = "gram",
    overwrite: bool = False,
) -> Whitening:
    """The whitening factor of a gram ``G = sum x x^T`` ``[in, in]``.

    Parameters
    ----------
    G : ndarray of shape (in, in)
        Symmetric, positive semi-definite (up to rounding).
    damping : float, default=1e-2
        ``delta = damping * mean(diag(G))`` is added to the diagonal (``delta = damping`` for an
        all-zero ``G``, so the fit falls back to the weight error).
    where : str
        What to name in an error (the statistics key).
    overwrite : bool, default=False
        ``G`` may be overwritten: the damped gram is then formed in ``G`` itself (a caller
        that read the gram for this alone passes True). Otherwise, and whenever ``G`` is not
        float64, it is formed in one copy.

    Returns
    -------
    Whitening
        ``S`` with ``S S^T = G + delta I``.

    Memory: ``delta`` is added to the diagonal in place (no identity, scaled identity or sum of
    ``G``'s size), so making ``S`` holds ``G`` (or its one copy), the factor, and the one
    working copy LAPACK's Cholesky takes: ``3 x 8 n^2`` bytes with ``overwrite``, ``4 x`` without.
    The result is bit-identical to factoring ``G + delta * np.eye(n)``.
    """
    given = G
    G = np.asarray(G, dtype=np.float64)
    if G.ndim != 2 or G.shape[0] != G.shape[1]:
        raise CalibrationError(f"{where}: shape {list(G.shape)} is not square [in, in]")
    if damping < 0:
        raise CalibrationError(f"damping must be >= 0, got {damping}")
    mean_diag = float(np.mean(np.diagonal(G))) if G.size else 0.0
    delta = damping * mean_diag if mean_diag > 0 else max(damping, 1e-12)
    n = G.shape[0]
    # ``G + delta * np.eye(n)`` adds ``+0.0`` off the diagonal, which turns a ``-0.0`` into
    # ``+0.0``: in place, G is used only when it has none (then the add is the identity there,
    # and restoring the diagonal restores G exactly); else a copy gets ``+= 0.0`` first.
    in_place = (overwrite or G is not given) and not _has_negative_zero(G)
    if in_place:
        diagonal = np.diagonal(G).copy()
        damped = G
    else:
        damped = G.copy()
        np.add(damped, 0.0, out=damped)
    damped.flat[:: n + 1] += delta  # (delta * 1.0 == delta: the same sum as with np.eye)
    try:
        return Whitening(factor=np.linalg.cholesky(damped), delta=delta)
    except np.linalg.LinAlgError:
        pass
    if in_place:
        G.flat[:: n + 1] = diagonal  # G as it was, bit for bit
    del damped
    w, Q = np.linalg.eigh(0.5 * (G + G.T))
    # Rounding of a PSD gram leaves eigenvalues of order eps * |G| below 0; more is an error.
    tolerance = delta + 1e-10 * max(float(np.abs(w).max()), 1e-300)
    if w.min() < -tolerance:
        raise CalibrationError(
            f"{where} is not positive semi-definite beyond the damping (smallest eigenvalue "
            f"{w.min():.4g} < -{delta:.4g}); a gram is sum_t x_t x_t^T"
        )
    eigen = np.sqrt(np.maximum(w, 0.0) + delta)
    return Whitening(factor=Q * eigen, delta=delta, eigen=eigen, basis=Q)


def output_error(delta_W: np.ndarray, G: np.ndarray) -> float:
    """``||delta_W X||_F = sqrt(tr(delta_W G delta_W^T))`` from the gram alone."""
    D = np.asarray(delta_W, dtype=np.float64)
    return float(np.sqrt(max(float(np.sum((D @ G) * D)), 0.0)))


def _svd(A: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    try:
        return scipy.linalg.svd(A, full_matrices=False, lapack_driver="gesdd")
    except np.linalg.LinAlgError:  # pragma: no cover - gesdd rarely fails to converge
        return scipy.linalg.svd(A, full_matrices=False, lapack_driver="gesvd")


def whitened_spectrum(W: np.ndarray, white: Whitening) -> np.ndarray:
    """Singular values of ``W S``: truncating to rank ``r`` leaves output error ``sum_{i>=r} s_i^2``."""
    return scipy.linalg.svdvals(white.whiten(W))


def whitened_svd(
    W: np.ndarray, white: Whitening, rank: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rank-``rank`` minimiser of ``||(W - U V^T) S||_F`` (SVD-LLM's truncation-aware SVD).

    Steps: SVD ``W S = P diag(sigma) Q^T``; keep ``r`` triplets; ``U = P_r diag(sigma_r)``,
    ``V = S^{-T} Q_r`` so that ``U V^T = [W S]_r S^{-1}`` (Eckart-Young in the whitened space).

    Returns
    -------
    U : ndarray of shape (out, rank)
    V : ndarray of shape (in, rank)
    sigma : ndarray of shape (min(out, in),)
        The whole whitened spectrum (for the predicted output error).
    """
    W = np.asarray(W, dtype=np.float64)
    if rank < 0 or rank > min(W.shape):
        raise CalibrationError(
            f"rank {rank} is outside 0..{min(W.shape)} for shape {list(W.shape)}"
        )
    P, sigma, Qt = _svd(white.whiten(W))
    U = P[:, :rank] * sigma[:rank]
    V = white.unwhiten(Qt[:rank].T)
    return U, V, sigma


def whitened_row_scale(W: np.ndarray, W0: np.ndarray, white: Whitening) -> np.ndarray:
    """Per-row ``s`` minimising ``||(W - diag(s) W0) S||_F`` (0 where ``W0``'s row weighs 0).

    Row by row: ``s_o = <W_o S, W0_o S> / <W0_o S, W0_o S>``.
    """
    return row_scale_whitened(white.whiten(W), white.whiten(W0))


def row_scale_whitened(A: np.ndarray, B: np.ndarray) -> np.ndarray:
    """:func:`whitened_row_scale` from ``A = W S`` and ``B = W0 S`` already made."""
    num = np.sum(A * B, axis=1)
    den = np.sum(B * B, axis=1)
    safe = den > 0
    return np.where(safe, num / np.where(safe, den, 1.0), 0.0)


def whitened_residual_svd(
    W: np.ndarray, W0: np.ndarray, white: Whitening, rank: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Banded theta, whitened: ``s`` by whitened least squares, then the whitened rank-``rank``
    SVD of the residual ``W - diag(s) W0``. Returns ``(s, U, V)``."""
    s = whitened_row_scale(W, W0, white)
    R = np.asarray(W, dtype=np.float64) - s[:, None] * np.asarray(W0, dtype=np.float64)
    U, V, _ = whitened_svd(R, white, rank)
    return s, U, V


def whitened_shared_basis(
    weights: Sequence[np.ndarray],
    whites: Sequence[Whitening],
    rank: int,
    *,
    side: Literal["in", "out"],
) -> tuple[np.ndarray, list[np.ndarray]]:
    """A basis shared by a band's layers, fit for the output error (Basis Sharing).

    ``side="out"``: ``W_l ~ B C_l`` with ``B [out, rank]``; ``B`` is the top left singular
    subspace of ``[W_1 S_1, ..., W_n S_n]`` and ``C_l = B^T W_l``. This is the exact minimiser of
    ``sum_l ||(W_l - B C_l) S_l||^2``: for a fixed ``B`` the best ``C_l S_l`` is
    ``B^T W_l S_l``. Returns ``(B, [C_l^T [in, rank]])`` (the per-layer ``V_l``).

    ``side="in"``: ``W_l ~ U_l B^T`` with ``B [in, rank]``; as in Basis Sharing the basis is
    fit under the pooled gram ``sum_l G_l`` (whitened SVD of ``[W_1; ...; W_n]``), then each
    ``U_l = W_l G_l B (B^T G_l B)^+`` is the exact least-squares coefficient under the layer's
    own gram. Returns ``(B, [U_l [out, rank]])``.
    """
    if not weights or len(weights) != len(whites):
        raise CalibrationError("one whitening per weight is needed, and at least one weight")
    Ws = [np.asarray(W, dtype=np.float64) for W in weights]
    if side == "out":
        P, _, _ = _svd(
            np.concatenate([w.whiten(W) for W, w in zip(Ws, whites, strict=True)], axis=1)
        )
        B = P[:, :rank]
        return B, [(B.T @ W).T for W in Ws]
    if side != "in":
        raise CalibrationError(f"side must be 'in' or 'out', got {side!r}")
    pooled = whitening(sum(w.gram() for w in whites), damping=0.0, where="pooled gram")
    _, _, Qt = _svd(pooled.whiten(np.concatenate(Ws, axis=0)))
    B = pooled.unwhiten(Qt[:rank].T)
    coefs = []
    for W, w in zip(Ws, whites, strict=True):
        G = w.gram()
        GB = G @ B
        coefs.append(W @ GB @ np.linalg.pinv(B.T @ GB))
    return B, coefs
