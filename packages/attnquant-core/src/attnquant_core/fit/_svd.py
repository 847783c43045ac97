"""Truncated SVD: the randomized range finder of Halko et al. (2009), exact for small matrices.

Written in the manner of scikit-learn's ``randomized_svd``: array positional, options
keyword-only, "auto" resolved first, float32 in gives float32 out.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import numpy as np
import scipy.linalg

from .._errors import DecompositionError
from ..forms._identity import compute_dtype

__all__ = ["EXACT_MAX_DIM", "LowRank", "compute_dtype", "randomized_svd", "truncated_svd"]

#: Matrices whose smaller side is at most this use an exact SVD (docs/architecture.md).
EXACT_MAX_DIM = 256

Normalizer = Literal["auto", "LU", "QR", "none"]


class LowRank(NamedTuple):
    """A rank-``r`` factorisation ``U @ V.T`` of a ``[out, in]`` matrix.

    ``U`` is ``[out, r]`` and absorbs the singular values, ``V`` is ``[in, r]``,
    ``S`` holds the ``r`` singular values in decreasing order.
    """

    U: np.ndarray
    V: np.ndarray
    S: np.ndarray


def _rng(random_state: int | np.random.Generator | None) -> np.random.Generator:
    # Seeded by default: the same checkpoint always decomposes to the same bytes.
    if isinstance(random_state, np.random.Generator):
        return random_state
    return np.random.default_rng(0 if random_state is None else random_state)


def _normalize(Y: np.ndarray, how: str) -> np.ndarray:
    if how == "LU":
        PL, _ = scipy.linalg.lu(Y, permute_l=True, check_finite=False, overwrite_a=True)
        return PL
    if how == "QR":
        Q, _ = scipy.linalg.qr(Y, mode="economic", check_finite=False, overwrite_a=True)
        return Q
    return Y


def _svd(M: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    try:
        return scipy.linalg.svd(M, full_matrices=False, check_finite=False, lapack_driver="gesdd")
    except np.linalg.LinAlgError:  # pragma: no cover - gesdd rarely fails to converge
        return scipy.linalg.svd(M, full_matrices=False, check_finite=False, lapack_driver="gesvd")


def randomized_svd(
    M: np.ndarray,
    n_components: int,
    *,
    n_oversamples: int = 10,
    n_iter: int | Literal["auto"] = "auto",
    power_iteration_normalizer: Normalizer = "auto",
    random_state: int | np.random.Generator | None = 0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Randomized truncated SVD of ``M`` (Halko, Martinsson & Tropp 2009, Alg. 4.4 + 5.1).

    Parameters
    ----------
    M : ndarray of shape (m, n)
        Real matrix, computed in :func:`compute_dtype` of its dtype.
    n_components : int
        Number of singular triplets kept.
    n_oversamples : int, default=10
        Extra random probes; the sketch has ``n_components + n_oversamples`` columns.
    n_iter : int or "auto", default="auto"
        Power iterations. "auto" is 7 when ``n_components < 0.1 * min(m, n)`` (slowly
        decaying spectra need more passes there), else 4, as in scikit-learn.
    power_iteration_normalizer : {"auto", "LU", "QR", "none"}, default="auto"
        Re-orthonormalisation between passes; "auto" is LU (cheaper than QR, stable
        enough for the power scheme) unless ``n_iter <= 2``, then "none".
    random_state : int, Generator or None, default=0
        Seed of the Gaussian test matrix; None means 0 (deterministic).

    Returns
    -------
    U : ndarray of shape (m, n_components)
    S : ndarray of shape (n_components,)
    Vt : ndarray of shape (n_components, n)

    References
    ----------
    N. Halko, P.-G. Martinsson, J. A. Tropp, "Finding structure with randomness:
    probabilistic algorithms for constructing approximate matrix decompositions", 2009.
    """
    dtype = compute_dtype(M.dtype)
    M = np.asarray(M, dtype=dtype)
    m, n = M.shape
    k = int(n_components)
    if not 0 < k <= min(m, n):
        raise DecompositionError(f"n_components={k} is outside 1..{min(m, n)} for shape {M.shape}")
    if n_iter == "auto":
        n_iter = 7 if k < 0.1 * min(m, n) else 4
    if power_iteration_normalizer == "auto":
        power_iteration_normalizer = "none" if n_iter <= 2 else "LU"
    rng = _rng(random_state)

    # Work on the tall orientation so the sketch lives in the larger space's complement.
    transpose = m < n
    A = M.T if transpose else M
    size = min(k + n_oversamples, min(m, n))

    # Step 1 (range finder): Y = A @ Omega, refined by power iterations A (A^T A)^q Omega.
    Q = rng.standard_normal(size=(A.shape[1], size), dtype=dtype)
    for _ in range(n_iter):
        Q = _normalize(A @ Q, power_iteration_normalizer)
        Q = _normalize(A.T @ Q, power_iteration_normalizer)
    Q, _ = scipy.linalg.qr(A @ Q, mode="economic", check_finite=False, overwrite_a=True)

    # Step 2: project onto the range, B = Q^T A, and take the small exact SVD of B.
    B = Q.T @ A
    Uh, S, Vt = _svd(B)
    del B
    U = Q @ Uh[:, :k]
    S, Vt = S[:k], Vt[:k]
    if transpose:
        U, Vt = Vt.T, U.T
    return np.ascontiguousarray(U, dtype=dtype), S.astype(dtype), np.ascontiguousarray(Vt, dtype)


def truncated_svd(
    M: np.ndarray,
    rank: int,
    *,
    n_oversamples: int = 10,
    n_iter: int | Literal["auto"] = "auto",
    random_state: int | np.random.Generator | None = 0,
    exact_max_dim: int = EXACT_MAX_DIM,
) -> LowRank:
    """Rank-``rank`` truncation of ``M`` as ``U @ V.T`` with ``U`` absorbing the singular values.

    Exact (LAPACK ``gesdd``) when ``min(M.shape) <= exact_max_dim`` or when the oversampled
    sketch would cover the whole matrix (``rank + n_oversamples >= min(M.shape)``); randomized
    otherwise. ``rank = 0`` gives empty ``[out, 0]`` / ``[in, 0]`` factors.
    """
    dtype = compute_dtype(M.dtype)
    M = np.asarray(M, dtype=dtype)
    if M.ndim != 2:
        raise DecompositionError(f"truncated_svd needs a 2-D matrix, got shape {M.shape}")
    out_dim, in_dim = M.shape
    if isinstance(rank, bool) or not isinstance(rank, int | np.integer) or rank < 0:
        raise DecompositionError(f"rank must be a non-negative int, got {rank!r}")
    rank = int(rank)
    if rank > min(out_dim, in_dim):
        raise DecompositionError(
            f"rank={rank} exceeds min(out, in)={min(out_dim, in_dim)} for a [{out_dim}, {in_dim}] "
            f"matrix; choose rank <= {min(out_dim, in_dim)}"
        )
    if rank == 0:
        empty = np.zeros((0,), dtype)
        return LowRank(np.zeros((out_dim, 0), dtype), np.zeros((in_dim, 0), dtype), empty)
    if not M.any():  # an exact zero residual (passthrough): nothing to factor
        return LowRank(
            np.zeros((out_dim, rank), dtype), np.zeros((in_dim, rank), dtype), np.zeros(rank, dtype)
        )
    if min(out_dim, in_dim) <= exact_max_dim or rank + n_oversamples >= min(out_dim, in_dim):
        U, S, Vt = _svd(M)
        U, S, Vt = U[:, :rank], S[:rank], Vt[:rank]
    else:
        U, S, Vt = randomized_svd(
            M, rank, n_oversamples=n_oversamples, n_iter=n_iter, random_state=random_state
        )
    U = np.ascontiguousarray(U * S[np.newaxis, :], dtype=dtype)
    return LowRank(U, np.ascontiguousarray(Vt.T, dtype=dtype), np.ascontiguousarray(S, dtype))
