"""The low-rank and shared-basis forms: the one identity with parts absent or shared."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnquant_core import (
    FamilyTheta,
    LayerTheta,
    LowRankFamily,
    SharedBasisFamily,
    ThetaCheckpoint,
    ThetaFormatError,
    ThetaModel,
    apply,
    band_of_layers,
    reconstruct,
    save_theta,
)

DTYPES = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16]


def _rand(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


def lowrank_family(name="f", L=3, out_dim=7, in_dim=5, ranks=(2, 0, 3), dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return LowRankFamily(
        name=name,
        U=tuple(_rand(rng, (out_dim, r), dtype) for r in ranks[:L]),
        V=tuple(_rand(rng, (in_dim, r), dtype) for r in ranks[:L]),
    )


def shared_family(
    name="f", side="in", L=5, G=2, out_dim=7, in_dim=5, widths=(3, 1), dtype=np.float32, seed=0
):
    rng = np.random.default_rng(seed)
    bands = band_of_layers(L, G)
    basis_dim, coef_dim = (in_dim, out_dim) if side == "in" else (out_dim, in_dim)
    return SharedBasisFamily(
        name=name,
        side=side,
        bases=tuple(_rand(rng, (basis_dim, widths[b]), dtype) for b in range(G)),
        bands=tuple(bands),
        coefs=tuple(_rand(rng, (coef_dim, widths[b]), dtype) for b in bands),
    )


# -- the identity -----------------------------------------------------------------------------


def test_absent_s_and_w0_give_u_vt():
    rng = np.random.default_rng(0)
    U, V = _rand(rng, (6, 2), np.float64), _rand(rng, (4, 2), np.float64)
    np.testing.assert_array_equal(reconstruct(None, None, U, V), U @ V.T)
    x = _rand(rng, (3, 4), np.float64)
    np.testing.assert_allclose(apply(x, None, None, U, V), x @ (U @ V.T).T, rtol=1e-12)
    with pytest.raises(ThetaFormatError, match="both given or both None"):
        reconstruct(np.ones(6), None, U, V)
    with pytest.raises(ThetaFormatError, match="both given or both None"):
        apply(x, None, np.ones((6, 4)), U, V)


def test_rank_zero_lowrank_is_zero():
    fam = lowrank_family(ranks=(0, 0, 0))
    assert fam.rank == 0 and fam.stored_parameters() == 0
    np.testing.assert_array_equal(fam.reconstruct(1), np.zeros((7, 5), np.float32))
    assert fam.apply(0, np.ones((2, 5), np.float32)).shape == (2, 7)


@pytest.mark.parametrize("side", ["in", "out"])
def test_shared_basis_factors_are_the_identity(side):
    fam = shared_family(side=side)
    assert fam.shape == (7, 5) and fam.ranks == (3, 3, 3, 1, 1) and fam.rank == 3
    for layer in range(fam.num_layers):
        s, W0, U, V = fam.factors(layer)
        assert s is None and W0 is None
        B, C = fam.basis(layer), fam.coefs[layer]
        want = C @ B.T if side == "in" else B @ C.T
        np.testing.assert_allclose(fam.reconstruct(layer), want, rtol=1e-6)
        assert np.array_equal(fam.reconstruct(layer), reconstruct(s, W0, U, V))
    assert fam.dense_parameters() == 5 * 7 * 5


def test_stored_parameters_count_each_part():
    fam = lowrank_family()
    assert fam.stored_parameters() == (2 + 0 + 3) * (7 + 5)
    out = shared_family(side="out")
    assert out.stored_parameters() == 7 * (3 + 1) + 5 * (3 * 3 + 1 * 2)
    fam_in = shared_family(side="in")
    assert fam_in.stored_parameters() == 5 * (3 + 1) + 7 * (3 * 3 + 1 * 2)


def test_banded_family_keeps_its_api_and_allows_per_layer_ranks():
    rng = np.random.default_rng(0)
    layers = tuple(
        LayerTheta(
            s=_rand(rng, (4,), np.float32),
            U=_rand(rng, (4, r), np.float32),
            V=_rand(rng, (3, r), np.float32),
        )
        for r in (1, 2, 0)
    )
    fam = FamilyTheta(
        name="f", shared=(_rand(rng, (4, 3), np.float32),), bands=(0, 0, 0), layers=layers
    )
    assert fam.form == "banded" and fam.ranks == (1, 2, 0) and fam.rank == 2 and fam.blocks == 1
    s, W0, U, V = fam.factors(1)
    assert np.array_equal(fam.reconstruct(1), reconstruct(s, W0, U, V))


# -- validation -------------------------------------------------------------------------------


def test_lowrank_validates_shapes_listing_layers():
    rng = np.random.default_rng(0)
    U = [_rand(rng, (4, 2), np.float32)] * 3
    V = [
        _rand(rng, (3, 2), np.float32),
        _rand(rng, (3, 1), np.float32),
        _rand(rng, (5, 2), np.float32),
    ]
    with pytest.raises(
        ThetaFormatError, match=r"f: layers \[1, 2\] do not fit U \[4, r\], V \[3, r\]"
    ):
        LowRankFamily(name="f", U=U, V=V)
    with pytest.raises(ThetaFormatError, match="one U and one V per layer"):
        LowRankFamily(name="f", U=U, V=U[:2])
    with pytest.raises(ThetaFormatError, match=r"layers \[0\] have U or V that is not 2-D"):
        LowRankFamily(name="f", U=[np.ones(4)], V=[np.ones((3, 0))])


def test_shared_basis_validates_side_bands_and_widths():
    fam = shared_family()
    with pytest.raises(ThetaFormatError, match="side must be 'in' or 'out'"):
        SharedBasisFamily(name="f", side="up", bases=fam.bases, bands=fam.bands, coefs=fam.coefs)
    with pytest.raises(ThetaFormatError, match="contiguous"):
        SharedBasisFamily(
            name="f", side="in", bases=fam.bases, bands=(0, 1, 0, 1, 1), coefs=fam.coefs
        )
    coefs = list(fam.coefs)
    coefs[4] = np.ones((7, 3), np.float32)  # band 1's basis is 1 wide
    with pytest.raises(ThetaFormatError, match=r"f: layers \[4\] have U of shapes \[7, 3\]"):
        SharedBasisFamily(name="f", side="in", bases=fam.bases, bands=fam.bands, coefs=coefs)
    with pytest.raises(ThetaFormatError, match=r"bases of bands \[1\] do not have 5 rows"):
        SharedBasisFamily(
            name="f",
            side="in",
            bases=(fam.bases[0], np.ones((4, 1))),
            bands=fam.bands,
            coefs=fam.coefs,
        )


def test_theta_model_accepts_every_form_and_refuses_others():
    model = ThetaModel(
        families={"a": lowrank_family("a", L=3), "b": shared_family("b", L=3, G=1, widths=(2,))}
    )
    assert model.blocks is None and not model.passthrough and model.rank == 3
    assert model.forms == {"a": "lowrank", "b": "shared_basis"}
    with pytest.raises(ThetaFormatError, match="not a theta family"):
        ThetaModel(families={"a": np.ones(3)})  # type: ignore[dict-item]


# -- properties over shapes, ranks, bands and dtypes ---------------------------------------------


@st.composite
def any_family(draw):
    L = draw(st.integers(1, 5))
    out_dim, in_dim = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**16))
    form = draw(st.sampled_from(["lowrank", "in", "out"]))
    if form == "lowrank":
        ranks = draw(st.lists(st.integers(0, min(out_dim, in_dim)), min_size=L, max_size=L))
        return lowrank_family(
            L=L, out_dim=out_dim, in_dim=in_dim, ranks=ranks, dtype=dtype, seed=seed
        )
    G = draw(st.integers(1, L))
    widths = draw(st.lists(st.integers(0, 6), min_size=G, max_size=G))
    return shared_family(
        side=form, L=L, G=G, out_dim=out_dim, in_dim=in_dim, widths=widths, dtype=dtype, seed=seed
    )


@settings(max_examples=30, deadline=None)
@given(any_family())
def test_apply_equals_reconstruct_matmul(fam):
    out_dim, in_dim = fam.shape
    for layer in range(fam.num_layers):
        x = np.random.default_rng(layer).standard_normal((3, in_dim)).astype(np.float32)
        W = fam.reconstruct(layer)
        assert W.shape == (out_dim, in_dim)
        ref = x.astype(np.float64) @ W.astype(np.float64).T
        y = fam.apply(layer, x)
        assert y.shape == (3, out_dim)
        np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4 * (1 + np.abs(ref).max()))


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(any_family())
def test_every_form_round_trips_and_rebuilds_what_the_identity_says(tmp_path_factory, fam):
    out = tmp_path_factory.mktemp("theta") / "t"
    save_theta(ThetaModel(families={"mlp.up_proj": fam}), out)
    ckpt = ThetaCheckpoint.open(out)
    back = ckpt.family_theta("mlp.up_proj")
    assert type(back) is type(fam) and back.ranks == fam.ranks and back.shape == fam.shape
    assert ckpt.families["mlp.up_proj"]["ranks"] == list(fam.ranks)
    for a, b in zip(fam.arrays(), back.arrays(), strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    state = dict(ckpt.rebuilt_state())
    for layer in range(fam.num_layers):
        want = reconstruct(*fam.factors(layer)).astype(fam.dtype)
        assert np.array_equal(ckpt.rebuild("mlp.up_proj", layer), want)
        assert np.array_equal(state[f"model.layers.{layer}.mlp.up_proj.weight"], want)
