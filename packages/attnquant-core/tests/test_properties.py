"""Property tests over shapes, ranks, bands and dtypes (hypothesis)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnquant_core import (
    ThetaCheckpoint,
    ThetaModel,
    band_of_layers,
    band_sizes,
    decompose_family,
    save_theta,
)

DTYPES = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16]
TOL = {np.float32: 1e-4, np.float64: 1e-10, np.float16: 2e-2, ml_dtypes.bfloat16: 3e-2}


@st.composite
def families(draw):
    L = draw(st.integers(1, 6))
    out_dim, in_dim = draw(st.integers(1, 24)), draw(st.integers(1, 24))
    dtype = draw(st.sampled_from(DTYPES))
    G = draw(st.integers(1, L))
    rank = draw(st.integers(0, min(out_dim, in_dim)))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    weights = [rng.standard_normal((out_dim, in_dim)).astype(dtype) for _ in range(L)]
    return weights, G, rank, dtype


@given(st.integers(1, 200), st.data())
def test_bands_partition_the_layers(L, data):
    G = data.draw(st.integers(1, L))
    sizes = band_sizes(L, G)
    assert sum(sizes) == L
    assert len(sizes) == G
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)
    bands = band_of_layers(L, G)
    assert bands == sorted(bands)
    assert set(bands) == set(range(G))


@settings(max_examples=60, deadline=None)
@given(families())
def test_decomposition_shapes_and_identity(case):
    weights, G, rank, dtype = case
    theta, errs = decompose_family(weights, blocks=G, rank=rank)
    out_dim, in_dim = weights[0].shape
    assert theta.blocks == G
    assert list(theta.bands) == band_of_layers(len(weights), G)
    for layer in range(len(weights)):
        t = theta.layers[layer]
        assert t.s.shape == (out_dim,)
        assert t.U.shape == (out_dim, rank)
        assert t.V.shape == (in_dim, rank)
        assert t.s.dtype == t.U.dtype == np.dtype(dtype)
        x = np.random.default_rng(layer).standard_normal((3, in_dim)).astype(np.float32)
        y = theta.apply(layer, x)
        ref = x.astype(np.float64) @ theta.reconstruct(layer).astype(np.float64).T
        np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4 * (1 + np.abs(ref).max()))
        # With a full-rank correction every weight comes back up to storage rounding.
        if rank == min(out_dim, in_dim):
            assert errs.errors[layer] <= TOL[dtype] * 10
    if len(weights) == G:
        assert errs.total == 0.0
    assert errs.total <= decompose_family(weights, blocks=G, rank=0)[1].total + TOL[dtype]


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(families())
def test_format_round_trip(tmp_path_factory, case):
    weights, G, rank, _ = case
    theta, _ = decompose_family(weights, blocks=G, rank=rank, name="mlp.up_proj")
    out = tmp_path_factory.mktemp("theta") / "t"
    save_theta(ThetaModel(families={"mlp.up_proj": theta}), out)
    back = ThetaCheckpoint.open(out).family("mlp.up_proj")
    assert back.bands == theta.bands
    for a, b in zip(theta.shared, back.shared, strict=True):
        assert a.dtype == b.dtype
        assert np.array_equal(a, b)
    for a, b in zip(theta.layers, back.layers, strict=True):
        for part in "sUV":
            assert np.array_equal(getattr(a, part), getattr(b, part))
