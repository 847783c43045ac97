"""Sequential correction: fit each projection so the compressed model reproduces the dense one.

The whitened fits (:mod:`attnquant_core.fit._whiten`) minimise ``||(W - W_hat) X||`` over the
inputs ``X`` the projection sees *in the dense model*. Once the earlier layers are compressed,
the projection sees other inputs ``X_hat``; SVD-LLM V2 and Basis Sharing refit against them.
The objective here, for one projection with dense weight ``W`` ``[out, in]``, dense inputs
``X`` and the compressed model's inputs ``X_hat`` (``[in, N]``, the same ``N`` tokens), is

    J(W_hat) = ||W X - W_hat X_hat||_F^2 + delta ||W - W_hat||_F^2

the output of the compressed projection on the compressed inputs against the dense output on
the dense inputs. The ridge term (``delta = damping * mean(diag(X_hat X_hat^T))``, the same
damping as the whitening) keeps directions the calibration never excited at the dense weight.
With ``G_hat = X_hat X_hat^T``, ``C = X_hat X^T`` and ``S S^T = G_hat + delta I``::

    J(W_hat) = ||(W_hat - W_tilde) S||_F^2 + const,
    W_tilde  = W (C^T + delta I) (G_hat + delta I)^{-1}

(expand both sides; the normal equations of ``J`` are ``W_hat (G_hat + delta I) = W (C^T +
delta I)``). So every form's sequential fit is its *whitened* fit, under the compressed
inputs' gram, of the corrected target ``W_tilde`` (:func:`sequential_target`): the per-layer
low rank is the truncated SVD of ``W_tilde S`` (jointly optimal ``U``, ``V``; for the ``V`` it
returns, its ``U`` is also the closed-form least-squares ``U = argmin ||W X - U V^T X_hat||``,
:func:`left_factor`), a banded layer's ``s`` and residual SVD are fit against ``W_tilde``, and a
shared basis's per-layer coefficients are refit by least squares (:func:`refit_coefficients`)
while the basis itself stays what the band's dense statistics gave. When ``X_hat = X`` the
target is ``W`` and everything reduces to the non-sequential whitened fit.

Everything is computed in float64.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import scipy.linalg

from ..io._calibration import CalibrationError
from ._whiten import DEFAULT_DAMPING, Whitening, whitening

__all__ = [
    "left_factor",
    "refit_coefficients",
    "sequential_error",
    "sequential_target",
]


def sequential_target(
    W: np.ndarray,
    G_hat: np.ndarray,
    cross: np.ndarray,
    *,
    damping: float = DEFAULT_DAMPING,
    where: str = "gram",
) -> tuple[np.ndarray, Whitening]:
    """The corrected target ``W_tilde`` and the whitening ``S`` of the compressed inputs.

    Parameters
    ----------
    W : ndarray of shape (out, in)
        The dense weight.
    G_hat : ndarray of shape (in, in)
        ``sum x_hat x_hat^T`` over the calibration tokens, ``x_hat`` the projection's input in
        the compressed model.
    cross : ndarray of shape (in, in)
        ``C = sum x_hat x^T`` over the same tokens, ``x`` the input in the dense model.
    damping : float
        As for :func:`attnquant_core.calib.whitening`; ``delta`` is also the ridge weight.

    Returns
    -------
    target : ndarray of shape (out, in)
        ``W (C^T + delta I) (G_hat + delta I)^{-1}``: ``J(W_hat) = ||(W_hat - target) S||^2 +
        const`` (see the module docstring).
    white : Whitening
        ``S`` with ``S S^T = G_hat + delta I``.
    """
    W = np.asarray(W, np.float64)
    C = np.asarray(cross, np.float64)
    if C.shape != (W.shape[1], W.shape[1]):
        raise CalibrationError(f"{where}: cross gram {list(C.shape)} is not [in, in]")
    white = whitening(G_hat, damping=damping, where=where)
    rhs = (C + white.delta * np.eye(C.shape[0])) @ W.T  # (C + delta I) W^T = ((C^T + dI) ... )^T
    M = white.gram()
    try:
        target_t = scipy.linalg.solve(M, rhs, assume_a="pos")
    except (np.linalg.LinAlgError, scipy.linalg.LinAlgError):  # pragma: no cover - damped
        target_t = np.linalg.lstsq(M, rhs, rcond=None)[0]
    return np.ascontiguousarray(target_t.T), white


def sequential_error(
    W: np.ndarray,
    W_hat: np.ndarray,
    G_hat: np.ndarray,
    cross: np.ndarray,
    dense_output2: float,
) -> float:
    """``||W X - W_hat X_hat||_F`` from the grams: ``dense_output2 = ||W X||^2``,
    ``- 2 tr(W_hat C W^T) + tr(W_hat G_hat W_hat^T)``."""
    W = np.asarray(W, np.float64)
    Wh = np.asarray(W_hat, np.float64)
    value = (
        float(dense_output2)
        - 2.0 * float(np.sum((Wh @ np.asarray(cross, np.float64)) * W))
        + float(np.sum((Wh @ np.asarray(G_hat, np.float64)) * Wh))
    )
    return float(np.sqrt(max(value, 0.0)))


def left_factor(target: np.ndarray, V: np.ndarray, white: Whitening) -> np.ndarray:
    """The least-squares ``U`` for a fixed right factor: ``argmin_U ||(target - U V^T) S||_F``.

    ``U = target M V (V^T M V)^+`` with ``M = S S^T``; with ``target`` from
    :func:`sequential_target` this is ``argmin_U ||W X - U V^T X_hat||^2 + delta ||W - U V^T||^2``
    (``target M = W (C^T + delta I)``).
    """
    V = np.asarray(V, np.float64)
    if V.shape[1] == 0:
        return np.zeros((np.shape(target)[0], 0))
    MV = white.gram() @ V
    return np.asarray(target, np.float64) @ MV @ np.linalg.pinv(V.T @ MV)


def refit_coefficients(
    target: np.ndarray, basis: np.ndarray, white: Whitening, side: Literal["in", "out"]
) -> np.ndarray:
    """A shared-basis layer's own factor, by least squares against the corrected target.

    ``side="out"`` (``W ~ B C``): ``C = (B^T B)^+ B^T target``, returned transposed as ``V``
    ``[in, k]`` (the minimiser of ``||(target - B C) S||`` for any invertible ``S``).
    ``side="in"`` (``W ~ U B^T``): ``U = target M B (B^T M B)^+`` (:func:`left_factor`).
    """
    B = np.asarray(basis, np.float64)
    T = np.asarray(target, np.float64)
    if side == "out":
        if B.shape[1] == 0:
            return np.zeros((T.shape[1], 0))
        return (np.linalg.pinv(B.T @ B) @ B.T @ T).T
    if side != "in":
        raise CalibrationError(f"side must be 'in' or 'out', got {side!r}")
    return left_factor(T, B, white)
