"""The identity: reconstruct and apply agree with each other and with the dense weight."""

from __future__ import annotations

import numpy as np
import pytest

from attnquant_core import (
    FamilyTheta,
    LayerTheta,
    ThetaFormatError,
    ThetaModel,
    apply,
    decompose_family,
    reconstruct,
)


def random_layer(out_dim=12, in_dim=9, r=3, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal(out_dim).astype(dtype),
        rng.standard_normal((out_dim, in_dim)).astype(dtype),
        rng.standard_normal((out_dim, r)).astype(dtype),
        rng.standard_normal((in_dim, r)).astype(dtype),
    )


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("batch_shape", [(), (1,), (5,), (2, 3)])
def test_apply_equals_dense_matmul(dtype, batch_shape):
    s, W0, U, V = random_layer(dtype=dtype)
    x = np.random.default_rng(1).standard_normal((*batch_shape, 9)).astype(dtype)
    W = (s[:, None] * W0.astype(np.float64)) + U.astype(np.float64) @ V.T.astype(np.float64)
    y = apply(x, s, W0, U, V)
    assert y.dtype == dtype and y.shape == (*batch_shape, 12)
    np.testing.assert_allclose(y, x.astype(np.float64) @ W.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(reconstruct(s, W0, U, V), W, rtol=1e-5, atol=1e-5)


def test_rank_zero_is_a_scaled_shared_block():
    s, W0, _, _ = random_layer()
    U, V = np.zeros((12, 0), np.float32), np.zeros((9, 0), np.float32)
    np.testing.assert_array_equal(reconstruct(s, W0, U, V), s[:, None] * W0)


def test_family_apply_matches_reconstruct():
    rng = np.random.default_rng(0)
    weights = [rng.standard_normal((16, 10)).astype(np.float32) for _ in range(5)]
    theta, _ = decompose_family(weights, blocks=2, rank=3)
    x = rng.standard_normal((4, 10)).astype(np.float32)
    for layer in range(5):
        np.testing.assert_allclose(
            theta.apply(layer, x), x @ theta.reconstruct(layer).T, rtol=1e-5, atol=1e-5
        )


def test_layer_theta_validates_shapes():
    with pytest.raises(ThetaFormatError, match="disagree"):
        LayerTheta(s=np.ones(3), U=np.ones((4, 2)), V=np.ones((5, 2)))
    with pytest.raises(ThetaFormatError, match="disagree"):
        LayerTheta(s=np.ones(3), U=np.ones((3, 2)), V=np.ones((5, 1)))


def test_family_theta_validates_bands_and_shapes():
    layer = LayerTheta(s=np.ones(3), U=np.ones((3, 1)), V=np.ones((4, 1)))
    W0 = np.ones((3, 4))
    with pytest.raises(ThetaFormatError, match="contiguous"):
        FamilyTheta(name="f", shared=(W0, W0), bands=(1, 0), layers=(layer, layer))
    with pytest.raises(ThetaFormatError, match="contiguous"):
        FamilyTheta(name="f", shared=(W0, W0), bands=(0, 0), layers=(layer, layer))
    with pytest.raises(ThetaFormatError, match="band entries"):
        FamilyTheta(name="f", shared=(W0,), bands=(0,), layers=(layer, layer))
    with pytest.raises(ThetaFormatError, match="do not match W0"):
        FamilyTheta(name="f", shared=(np.ones((3, 5)),), bands=(0,), layers=(layer,))


def test_theta_model_bands_are_per_family_but_layers_are_shared():
    layer = LayerTheta(s=np.ones(3), U=np.ones((3, 1)), V=np.ones((4, 1)))
    W0 = np.ones((3, 4))
    a = FamilyTheta(name="a", shared=(W0,), bands=(0, 0), layers=(layer, layer))
    b = FamilyTheta(name="b", shared=(W0, W0), bands=(0, 1), layers=(layer, layer))
    model = ThetaModel(families={"a": a, "b": b})
    assert model.blocks is None  # the banded families disagree
    assert ThetaModel(families={"a": a}).blocks == 1
    assert ThetaModel(families={"b": b}).passthrough
    c = FamilyTheta(name="c", shared=(W0,), bands=(0, 0, 0), layers=(layer,) * 3)
    with pytest.raises(ThetaFormatError, match="same number of layers"):
        ThetaModel(families={"a": a, "c": c})
