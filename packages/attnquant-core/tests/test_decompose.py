"""Decomposition of one family: band means, row scales, residual SVD, passthrough, bad input."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from attnquant_core import (
    DecompositionError,
    band_of_layers,
    band_sizes,
    decompose_family,
    relative_error,
    resolve_blocks,
    row_scale,
)


def family(L=6, shape=(48, 32), seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(shape)
    return [(base + 0.3 * rng.standard_normal(shape)).astype(dtype) for _ in range(L)]


@pytest.mark.parametrize(
    ("L", "G", "sizes"),
    [(6, 1, [6]), (6, 4, [2, 2, 1, 1]), (7, 3, [3, 2, 2]), (5, 5, [1] * 5), (26, 4, [7, 7, 6, 6])],
)
def test_band_sizes_are_equal_earlier_take_extra(L, G, sizes):
    assert band_sizes(L, G) == sizes
    assert band_of_layers(L, G) == [b for b, n in enumerate(sizes) for _ in range(n)]


def test_blocks_resolution_and_errors():
    assert resolve_blocks("layers", 7) == 7
    assert resolve_blocks("3", 7) == 3
    for bad in (0, 8, -1, "zero", 2.5):
        with pytest.raises(DecompositionError, match="blocks"):
            resolve_blocks(bad, 7)


def test_w0_is_band_mean_and_s_is_least_squares():
    weights = family(L=4)
    theta, _ = decompose_family(weights, blocks=2, rank=0)
    np.testing.assert_allclose(theta.shared[0], (weights[0] + weights[1]) / 2, rtol=1e-6)
    np.testing.assert_allclose(theta.shared[1], (weights[2] + weights[3]) / 2, rtol=1e-6)
    W, W0 = weights[2].astype(np.float64), theta.shared[1].astype(np.float64)
    for o in range(0, 48, 7):  # each row's scale minimises ||W[o] - s W0[o]||
        s_ref = np.linalg.lstsq(W0[o][:, None], W[o], rcond=None)[0][0]
        assert theta.layers[2].s[o] == pytest.approx(s_ref, rel=1e-5)


def test_residual_factor_is_the_optimal_rank_r_approximation():
    weights = family(L=3, shape=(64, 40))
    theta, errs = decompose_family(weights, blocks=1, rank=5)
    for layer, W in enumerate(weights):
        t = theta.layers[layer]
        R = W.astype(np.float64) - t.s[:, None].astype(np.float64) * theta.shared[0]
        S = np.linalg.svd(R, compute_uv=False)
        opt = np.sqrt(np.sum(S[5:] ** 2)) / np.linalg.norm(W.astype(np.float64))
        assert errs.errors[layer] == pytest.approx(opt, rel=1e-4)
        assert relative_error(W, theta.reconstruct(layer)) == pytest.approx(opt, rel=1e-4)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16, np.float64])
def test_passthrough_is_exact(dtype):
    weights = family(L=4, dtype=dtype)
    theta, errs = decompose_family(weights, blocks="layers", rank=4)
    assert theta.blocks == 4
    for layer, W in enumerate(weights):
        t = theta.layers[layer]
        assert t.s.dtype == np.dtype(dtype)
        assert np.all(t.s == 1) and not t.U.any() and not t.V.any()
        assert np.array_equal(theta.reconstruct(layer).astype(dtype), W)
    assert errs.errors == [0.0] * 4 and errs.total == 0.0


def test_more_blocks_and_rank_lower_the_error():
    weights = family(L=6)
    totals = {
        (G, r): decompose_family(weights, blocks=G, rank=r)[1].total
        for G in (1, 3, 6)
        for r in (0, 8)
    }
    assert totals[(1, 8)] < totals[(1, 0)]
    assert totals[(3, 0)] < totals[(1, 0)]
    assert totals[(6, 0)] == 0.0


def test_zero_rows_of_w0_get_zero_scale():
    weights = family(L=2)
    for W in weights:
        W[3] = 0
    theta, _ = decompose_family(weights, blocks=1, rank=2)
    assert all(t.s[3] == 0 for t in theta.layers)
    s = row_scale(np.ones((2, 3)), np.array([[0.0, 0, 0], [1, 1, 1]]))
    np.testing.assert_array_equal(s, [0.0, 1.0])


def test_half_precision_computes_in_float32_and_stores_in_source_dtype():
    weights = family(L=2, dtype=ml_dtypes.bfloat16)
    theta, _ = decompose_family(weights, blocks=1, rank=2)
    assert theta.shared[0].dtype == ml_dtypes.bfloat16
    assert theta.layers[0].U.dtype == ml_dtypes.bfloat16
    assert theta.reconstruct(0).dtype == np.float32


def test_bad_input():
    weights = family(L=3)
    with pytest.raises(DecompositionError, match="rank=33 exceeds"):
        decompose_family(weights, rank=33)
    with pytest.raises(DecompositionError, match=r"blocks=4 is outside 1\.\.3"):
        decompose_family(weights, blocks=4)
    with pytest.raises(DecompositionError, match="layer 1 is"):
        decompose_family([weights[0], weights[1][:, :5]])
    bad = [w.copy() for w in weights]
    bad[2][0, 0] = np.nan
    with pytest.raises(DecompositionError, match="layer 2 holds NaN"):
        decompose_family(bad)
