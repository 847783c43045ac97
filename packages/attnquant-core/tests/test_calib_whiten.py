"""Whitened fits minimise the output error ||(W - W_hat) X||, checked against exact references."""

from __future__ import annotations

import numpy as np
import pytest

from attnquant_core.calib import (
    output_error,
    whitened_residual_svd,
    whitened_row_scale,
    whitened_shared_basis,
    whitened_spectrum,
    whitened_svd,
    whitening,
)

OUT, IN, TOKENS = 12, 10, 400


def _skewed_inputs(seed: int = 0, tokens: int = TOKENS) -> np.ndarray:
    """``X [in, tokens]`` with a few loud channels and a correlated tail, like real activations."""
    rng = np.random.default_rng(seed)
    scales = np.geomspace(30.0, 0.05, IN)
    mix = np.eye(IN) + 0.3 * rng.standard_normal((IN, IN))
    return mix @ (scales[:, None] * rng.standard_normal((IN, tokens)))


def _err(W: np.ndarray, W_hat: np.ndarray, X: np.ndarray) -> float:
    return float(np.linalg.norm((W - W_hat) @ X))


def _reference_rank_r(W: np.ndarray, X: np.ndarray, r: int) -> np.ndarray:
    """Exact minimiser of ||(W - W_hat) X|| over rank-r W_hat for full-row-rank X:
    W_hat = [W X]_r X^+ (Eckart-Young on W X, whose row space stays in X's)."""
    P, s, Qt = np.linalg.svd(W @ X, full_matrices=False)
    return (P[:, :r] * s[:r]) @ Qt[:r] @ np.linalg.pinv(X)


@pytest.mark.parametrize("rank", [1, 3, 6])
@pytest.mark.parametrize("cholesky", [True, False])
def test_whitened_svd_is_the_exact_output_error_minimiser(rank: int, cholesky: bool) -> None:
    rng = np.random.default_rng(1)
    W = rng.standard_normal((OUT, IN))
    X = _skewed_inputs()
    G = X @ X.T
    white = whitening(G, damping=1e-12)
    if not cholesky:  # the eigendecomposition factor must give the same fit
        w, Q = np.linalg.eigh(G)
        eig = np.sqrt(w + white.delta)
        white = type(white)(factor=Q * eig, delta=white.delta, eigen=eig, basis=Q)
    np.testing.assert_allclose(white.gram(), G + white.delta * np.eye(IN), rtol=1e-10)
    U, V, sigma = whitened_svd(W, white, rank)
    assert U.shape == (OUT, rank) and V.shape == (IN, rank)
    W_hat = U @ V.T
    ref = _reference_rank_r(W, X, rank)
    np.testing.assert_allclose(W_hat, ref, rtol=1e-6, atol=1e-8)
    # The predicted output error is the whitened spectrum's tail.
    tail = float(np.sqrt(np.sum(sigma[rank:] ** 2)))
    assert _err(W, W_hat, X) == pytest.approx(tail, rel=1e-6)
    assert output_error(W - W_hat, G) == pytest.approx(tail, rel=1e-6)
    np.testing.assert_allclose(whitened_spectrum(W, white), sigma, rtol=1e-10)
    # Better than the weight-only SVD of the same rank on the output error, by a wide margin
    # with these skewed inputs; and no random rank-r perturbation of the optimum improves it.
    P, s, Qt = np.linalg.svd(W, full_matrices=False)
    plain = (P[:, :rank] * s[:rank]) @ Qt[:rank]
    assert _err(W, W_hat, X) < 0.8 * _err(W, plain, X)
    for _ in range(20):
        dU = 1e-3 * rng.standard_normal(U.shape)
        dV = 1e-3 * rng.standard_normal(V.shape)
        assert _err(W, (U + dU) @ (V + dV).T, X) >= _err(W, W_hat, X)


def test_rank_deficient_gram_falls_back_to_eigendecomposition() -> None:
    rng = np.random.default_rng(2)
    X = rng.standard_normal((IN, 3))  # 3 tokens: G has rank 3 of 10
    G = X @ X.T
    G[0, 0] -= 1e-9 * G[0, 0]  # a hair below PSD, as another tool's rounding could leave it
    white = whitening(G, damping=0.0)
    assert white.eigen is not None
    W = rng.standard_normal((OUT, IN))
    U, V, _ = whitened_svd(W, white, 3)
    # Rank 3 reproduces W on the 3 calibration tokens exactly.
    assert _err(W, U @ V.T, X) < 1e-6 * np.linalg.norm(W @ X)


def test_whitened_row_scale_is_the_least_squares_solution() -> None:
    rng = np.random.default_rng(3)
    W0 = rng.standard_normal((OUT, IN))
    W = (1 + 0.3 * rng.standard_normal(OUT))[:, None] * W0 + 0.2 * rng.standard_normal((OUT, IN))
    W0[4] = 0.0  # an all-zero row of W0 gets s = 0
    X = _skewed_inputs()
    white = whitening(X @ X.T, damping=1e-12)
    s = whitened_row_scale(W, W0, white)
    assert s[4] == 0.0
    for o in range(OUT):
        if o == 4:
            continue
        a, b = W[o] @ X, W0[o] @ X  # row o's outputs over the tokens
        assert s[o] == pytest.approx(float(a @ b / (b @ b)), rel=1e-8)
    # And the whitened residual SVD fits better than the unwhitened pipeline on the output.
    s_w, U, V = whitened_residual_svd(W, W0, white, 2)
    np.testing.assert_allclose(s_w, s)
    fit = s[:, None] * W0 + U @ V.T
    den = np.sum(W0 * W0, axis=1)
    s_plain = np.where(den > 0, np.sum(W * W0, axis=1) / np.where(den > 0, den, 1), 0)
    R = W - s_plain[:, None] * W0
    P, sv, Qt = np.linalg.svd(R, full_matrices=False)
    plain = s_plain[:, None] * W0 + (P[:, :2] * sv[:2]) @ Qt[:2]
    assert _err(W, fit, X) < _err(W, plain, X)


def test_shared_basis_out_side_is_exact_and_in_side_beats_unwhitened() -> None:
    rng = np.random.default_rng(4)
    Ws = [rng.standard_normal((OUT, IN)) for _ in range(3)]
    Xs = [_skewed_inputs(seed) for seed in range(3)]
    whites = [whitening(X @ X.T, damping=1e-12) for X in Xs]
    rank = 4
    B, Vs = whitened_shared_basis(Ws, whites, rank, side="out")
    assert B.shape == (OUT, rank) and all(V.shape == (IN, rank) for V in Vs)
    total = sum(_err(W, B @ V.T, X) ** 2 for W, V, X in zip(Ws, Vs, Xs, strict=True))
    # Exact reference: the top-r left subspace of [W_1 X_1, W_2 X_2, W_3 X_3].
    _, s, _ = np.linalg.svd(np.concatenate([W @ X for W, X in zip(Ws, Xs, strict=True)], axis=1))
    assert total == pytest.approx(float(np.sum(s[rank:] ** 2)), rel=1e-6)
    # Input side: W_l ~ U_l B^T; lower pooled output error than the weight-only shared basis.
    B_in, Us = whitened_shared_basis(Ws, whites, rank, side="in")
    assert B_in.shape == (IN, rank) and all(U.shape == (OUT, rank) for U in Us)
    fit = sum(_err(W, U @ B_in.T, X) ** 2 for W, U, X in zip(Ws, Us, Xs, strict=True))
    _, _, Qt = np.linalg.svd(np.concatenate(Ws, axis=0), full_matrices=False)
    Bp = Qt[:rank].T
    plain = sum(_err(W, W @ Bp @ Bp.T, X) ** 2 for W, X in zip(Ws, Xs, strict=True))
    assert fit < plain
