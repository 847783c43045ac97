"""Truncated SVD against the exact SVD: optimality, dtypes, fallbacks, determinism."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from attnquant_core import DecompositionError, randomized_svd, truncated_svd


def decaying(m: int, n: int, *, decay: float = 0.9, seed: int = 0, dtype=np.float64) -> np.ndarray:
    """A matrix with singular values ``decay**i`` and random singular vectors."""
    rng = np.random.default_rng(seed)
    k = min(m, n)
    U, _ = np.linalg.qr(rng.standard_normal((m, k)))
    V, _ = np.linalg.qr(rng.standard_normal((n, k)))
    return ((U * decay ** np.arange(k)) @ V.T).astype(dtype)


def optimal_error(M: np.ndarray, r: int) -> float:
    S = np.linalg.svd(M.astype(np.float64), compute_uv=False)
    return float(np.sqrt(np.sum(S[r:] ** 2)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(600, 400), (400, 600), (1024, 300)])
@pytest.mark.parametrize("rank", [8, 32, 64])
def test_randomized_is_within_one_percent_of_optimal(dtype, shape, rank):
    M = decaying(*shape, decay=0.97, dtype=dtype)
    low = truncated_svd(M, rank)
    assert low.U.dtype == dtype and low.V.dtype == dtype and low.S.dtype == dtype
    assert low.U.shape == (shape[0], rank) and low.V.shape == (shape[1], rank)
    err = float(np.linalg.norm(M.astype(np.float64) - low.U @ low.V.T.astype(np.float64)))
    assert err <= 1.01 * optimal_error(M, rank)


def test_randomized_singular_values_match_exact():
    M = decaying(700, 500, decay=0.95)
    _, S, _ = randomized_svd(M, 20)
    exact = np.linalg.svd(M, compute_uv=False)[:20]
    np.testing.assert_allclose(S, exact, rtol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_exact_path_matches_numpy_for_small_matrices(dtype):
    rng = np.random.default_rng(1)
    M = rng.standard_normal((200, 120)).astype(dtype)
    low = truncated_svd(M, 10)
    U, S, Vt = np.linalg.svd(M.astype(np.float64), full_matrices=False)
    ref = (U[:, :10] * S[:10]) @ Vt[:10]
    tol = 1e-4 if dtype == np.float32 else 1e-10
    np.testing.assert_allclose(low.U @ low.V.T, ref, atol=tol * np.abs(ref).max())
    np.testing.assert_allclose(low.S, S[:10], rtol=tol)


def test_exact_when_sketch_covers_the_matrix():
    # min(out, in) = 300 > 256, but rank + oversampling >= 300: the exact path, exact result.
    M = decaying(500, 300, decay=0.99)
    low = truncated_svd(M, 295)
    assert np.linalg.norm(M - low.U @ low.V.T) == pytest.approx(optimal_error(M, 295), rel=1e-6)


def test_rank_zero_gives_empty_factors():
    M = np.ones((5, 3), np.float32)
    low = truncated_svd(M, 0)
    assert low.U.shape == (5, 0) and low.V.shape == (3, 0) and low.U.dtype == np.float32


def test_full_rank_reconstructs_exactly():
    M = np.random.default_rng(2).standard_normal((7, 5))
    low = truncated_svd(M, 5)
    np.testing.assert_allclose(low.U @ low.V.T, M, atol=1e-12)


def test_zero_matrix_gives_zero_factors():
    low = truncated_svd(np.zeros((400, 300), np.float32), 4)
    assert not low.U.any() and not low.V.any()


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_half_inputs_compute_in_float32(dtype):
    M = np.random.default_rng(3).standard_normal((20, 10)).astype(dtype)
    assert truncated_svd(M, 3).U.dtype == np.float32


def test_seeded_and_deterministic():
    M = decaying(600, 500, decay=0.98)
    a, b = truncated_svd(M, 16), truncated_svd(M, 16)
    assert np.array_equal(a.U, b.U) and np.array_equal(a.V, b.V)


@pytest.mark.parametrize("rank", [-1, 6, 1.5, True])
def test_bad_rank_is_refused(rank):
    with pytest.raises(DecompositionError, match="rank"):
        truncated_svd(np.ones((5, 4)), rank)
