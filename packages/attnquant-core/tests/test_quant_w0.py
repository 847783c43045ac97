"""The 4-bit W0: ``W ~ diag(s) Q(W0) + U V^T`` with ``Q`` NVFP4 (format version 4).

At passthrough this is NVFP4 plus a low-rank correction of its quantization error (LQER); with
calibration statistics the correction is the whitened residual SVD (minimises the output error).
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attnquant_core as aq
from attnquant_core import (
    DecompositionError,
    FamilyTheta,
    ThetaCheckpoint,
    ThetaFormatError,
    ThetaModel,
    decompose_checkpoint,
    decompose_family,
    dequantize_nvfp4,
    quantize_nvfp4,
    row_scale,
    save_theta,
)
from attnquant_core.calib import whitening, write_stats
from attnquant_core.fit._decompose import quantized_band
from attnquant_core.fit._whitened import fit_layer_whitened
from attnquant_core.io import PlannedWriter, read_tensor_directory
from attnquant_core.testing import SHAPES16, make_weights, write_checkpoint

L = 3


def _weights(L: int = L, shape=(24, 48), seed: int = 0, dtype=np.float32) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(shape)
    return [(base + 0.5 * rng.standard_normal(shape)).astype(dtype) for _ in range(L)]


@pytest.fixture
def ckpt16(tmp_path) -> Path:
    return write_checkpoint(tmp_path / "dense", make_weights(L, shapes=SHAPES16))


# -- the fit ---------------------------------------------------------------------------------


def test_passthrough_w0_is_the_reference_nvfp4_of_each_weight_bit_for_bit():
    weights = _weights()
    fam, _ = decompose_family(weights, blocks="layers", rank=4, quant="nvfp4")
    assert fam.quant == "nvfp4" and fam.blocks == L and fam.dtype == np.float32
    for b, W in enumerate(weights):
        ref = quantize_nvfp4(W)
        q = fam.nvfp4[b]
        assert np.array_equal(q.weight, ref.weight)
        assert np.array_equal(q.weight_scale.view(np.uint8), ref.weight_scale.view(np.uint8))
        assert q.weight_scale_2 == ref.weight_scale_2
        assert fam.shared[b].dtype == np.float32
        assert np.array_equal(fam.shared[b], dequantize_nvfp4(ref))


def test_banded_w0_is_the_nvfp4_of_the_band_mean():
    weights = _weights(L=4)
    fam, _ = decompose_family(weights, blocks=2, rank=2, quant="nvfp4")
    for b in range(2):
        mean = (weights[2 * b] + weights[2 * b + 1]) / 2
        assert np.array_equal(fam.shared[b], dequantize_nvfp4(quantize_nvfp4(mean)))


def test_identity_apply_matches_reconstruct_and_the_numpy_formula():
    weights = _weights()
    fam, _ = decompose_family(weights, blocks="layers", rank=5, quant="nvfp4")
    x = np.random.default_rng(1).standard_normal((7, 48)).astype(np.float32)
    for layer in range(L):
        t = fam.layers[layer]
        W0 = dequantize_nvfp4(fam.nvfp4[layer]).astype(np.float64)
        by_hand = t.s.astype(np.float64)[:, None] * W0 + t.U.astype(np.float64) @ t.V.T
        W_eff = fam.reconstruct(layer)
        np.testing.assert_allclose(W_eff, by_hand, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(fam.apply(layer, x), x @ W_eff.T, rtol=1e-4, atol=1e-5)


def test_s_is_least_squares_and_the_correction_is_the_exact_svd_of_the_residual():
    weights = _weights()
    r = 6
    fam, errors = decompose_family(weights, blocks="layers", rank=r, quant="nvfp4")
    for layer, W in enumerate(weights):
        W0 = fam.shared[layer]
        s = row_scale(W, W0)
        np.testing.assert_allclose(fam.layers[layer].s, s, rtol=1e-5)
        R = W.astype(np.float64) - s.astype(np.float64)[:, None] * W0
        Ue, Se, Vte = np.linalg.svd(R, full_matrices=False)
        best = (Ue[:, :r] * Se[:r]) @ Vte[:r]
        t = fam.layers[layer]
        UV = t.U.astype(np.float64) @ t.V.T.astype(np.float64)
        assert np.linalg.norm(UV - best) <= 1e-4 * np.linalg.norm(best)
        # the stored error is the exact SVD's truncation error
        want = np.sqrt((Se[r:] ** 2).sum()) / np.linalg.norm(W)
        assert errors.errors[layer] == pytest.approx(want, rel=1e-3)
    # rank 0 is NVFP4 alone (s ~ 1); the correction lowers the weight error
    _, plain = decompose_family(weights, blocks="layers", rank=0, quant="nvfp4")
    assert errors.total < plain.total


def test_whitened_residual_beats_plain_in_output_error():
    """With anisotropic inputs, fitting the 4-bit residual under X's gram lowers ||(W - W_eff) X||."""
    rng = np.random.default_rng(2)
    W = rng.standard_normal((40, 64)).astype(np.float32)
    scales = np.exp(rng.uniform(-3, 2, 64))  # a few input directions carry most energy
    X = (rng.standard_normal((64, 2000)) * scales[:, None]).astype(np.float64)
    white = whitening(X @ X.T, damping=1e-3)
    _, W0 = quantized_band(W, "w")
    r = 8
    plain_fam, _ = decompose_family([W], blocks="layers", rank=r, quant="nvfp4")
    whitened, out_err = fit_layer_whitened(W, W0, r, white, dtype=np.dtype(np.float32))

    def output_error(s, U, V) -> float:
        W_eff = s.astype(np.float64)[:, None] * W0 + U.astype(np.float64) @ V.T.astype(np.float64)
        return float(np.linalg.norm((W - W_eff) @ X) / np.linalg.norm(W @ X))

    t = plain_fam.layers[0]
    plain_out = output_error(t.s, t.U, t.V)
    white_out = output_error(whitened.theta.s, whitened.theta.U, whitened.theta.V)
    nvfp4_out = output_error(np.ones(40, np.float32), np.zeros((40, 0)), np.zeros((64, 0)))
    assert white_out == pytest.approx(out_err, rel=1e-2)  # out_err: under the damped gram
    assert white_out < 0.8 * plain_out < nvfp4_out


@settings(max_examples=40, deadline=None)
@given(
    out_dim=st.integers(1, 24),
    blocks=st.integers(1, 4),
    L=st.integers(1, 3),
    rank=st.integers(0, 8),
    dtype=st.sampled_from([np.float32, np.float64, ml_dtypes.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_property_shapes_ranks_dtypes(out_dim, blocks, L, rank, dtype, seed):
    in_dim = 16 * blocks
    rank = min(rank, out_dim, in_dim)
    weights = _weights(L, (out_dim, in_dim), seed, dtype)
    fam, errors = decompose_family(weights, blocks="layers", rank=rank, quant="nvfp4")
    _, alone = decompose_family(weights, blocks="layers", rank=0, quant="nvfp4")
    assert fam.shape == (out_dim, in_dim) and fam.ranks == (rank,) * L
    assert fam.dtype == np.dtype(dtype)
    assert all(a.dtype == np.dtype(dtype) for a in fam.arrays())
    for layer, W in enumerate(weights):
        q = fam.nvfp4[layer]
        assert q.weight.shape == (out_dim, in_dim // 2) and q.weight.dtype == np.uint8
        assert q.weight_scale.shape == (out_dim, blocks)
        assert np.array_equal(fam.shared[layer], dequantize_nvfp4(quantize_nvfp4(W)))
        W_eff = fam.reconstruct(layer)
        assert W_eff.dtype == aq.compute_dtype(dtype) and np.isfinite(W_eff).all()
    # the correction never makes the weight error worse (up to the storage dtype's rounding)
    slack = 1e-2 if dtype == ml_dtypes.bfloat16 else 1e-5
    assert errors.total <= alone.total + slack
    expected = L * (out_dim * in_dim // 2 + out_dim * blocks + 4)
    expected += L * (out_dim + rank * (out_dim + in_dim)) * np.dtype(dtype).itemsize
    assert fam.stored_bytes() == expected


# -- the format ------------------------------------------------------------------------------


def test_save_and_open_round_trip_bit_for_bit(tmp_path):
    weights = _weights()
    fam, _ = decompose_family(weights, blocks="layers", rank=3, quant="nvfp4", name="mlp.up_proj")
    manifest = save_theta(ThetaModel(families={"mlp.up_proj": fam}), tmp_path / "t")
    assert manifest["format_version"] == 4 == aq.FORMAT_VERSION
    entry = manifest["families"]["mlp.up_proj"]
    assert entry["quant"] == "nvfp4" and entry["stored_bytes"] == fam.stored_bytes()
    ckpt = ThetaCheckpoint.open(tmp_path / "t")
    assert ckpt.quant("mlp.up_proj") == "nvfp4"
    back = ckpt.family("mlp.up_proj")
    for b in range(L):
        assert np.array_equal(back.nvfp4[b].weight, fam.nvfp4[b].weight)
        assert back.nvfp4[b].weight_scale.tobytes() == fam.nvfp4[b].weight_scale.tobytes()
        assert back.nvfp4[b].weight_scale_2 == fam.nvfp4[b].weight_scale_2
        assert np.array_equal(back.shared[b], fam.shared[b])
        assert np.array_equal(ckpt.shared("mlp.up_proj", b), fam.shared[b])
        assert np.array_equal(ckpt.rebuild("mlp.up_proj", b), fam.reconstruct(b))
    state = dict(ckpt.rebuilt_state())
    for layer in range(L):
        key = f"model.layers.{layer}.mlp.up_proj.weight"
        assert np.array_equal(state[key], fam.reconstruct(layer))
    tensors = ckpt.tensors
    assert tensors.spec("attnquant.shared.mlp.up_proj.0.W0_packed").shape == (24, 24)
    assert tensors.spec("attnquant.shared.mlp.up_proj.0.W0_scale").shape == (24, 3)
    assert tensors.spec("attnquant.shared.mlp.up_proj.0.W0_scale_2").shape == ()
    assert "attnquant.shared.mlp.up_proj.0.W0" not in tensors
    assert ckpt.load().families["mlp.up_proj"].quant == "nvfp4"


def test_decompose_checkpoint_writes_version_4_that_rebuilds_what_it_fitted(ckpt16, tmp_path):
    manifest = decompose_checkpoint(ckpt16, tmp_path / "t", blocks="layers", rank=4, quant="nvfp4")
    assert manifest["format_version"] == 4 and manifest["passthrough"]
    dense = aq.open_checkpoint(ckpt16)
    ckpt = ThetaCheckpoint.open(tmp_path / "t", blocks="layers")
    files_bytes = 0
    for name, info in dense.families.items():
        weights = [dense.get(k) for k in info.keys]
        fam, errors = decompose_family(weights, blocks="layers", rank=4, quant="nvfp4", name=name)
        entry = manifest["families"][name]
        assert entry["quant"] == "nvfp4" and entry["stored_bytes"] == fam.stored_bytes()
        assert entry["error"] == pytest.approx(errors.total, rel=1e-6)
        for layer in range(L):
            assert np.array_equal(ckpt.rebuild(name, layer), fam.reconstruct(layer))
        files_bytes += sum(
            ckpt.tensors.spec(k).nbytes
            for k in ckpt.tensors.keys()
            if k.startswith(f"attnquant.shared.{name}.") or f".{name}.theta_" in k
        )
    assert files_bytes == sum(f["stored_bytes"] for f in manifest["families"].values())


def test_decompose_checkpoint_with_statistics_fits_the_whitened_residual(ckpt16, tmp_path):
    rng = np.random.default_rng(3)
    dense = aq.open_checkpoint(ckpt16)
    grams = {}
    for info in dense.families.values():
        for key in info.keys:
            X = rng.standard_normal((info.shape[1], 256)) * np.exp(rng.uniform(-2, 1))
            X *= np.exp(rng.uniform(-3, 2, info.shape[1]))[:, None]
            grams[key] = X @ X.T
    stats = write_stats(tmp_path / "stats.safetensors", grams, tokens=256)
    kw = {"blocks": "layers", "rank": 4, "quant": "nvfp4"}
    decompose_checkpoint(ckpt16, tmp_path / "plain", **kw)
    # Rounded to nearest as without statistics (GPTQ's rounding: test_gptq.py).
    white = decompose_checkpoint(
        ckpt16, tmp_path / "white", calibration=stats, rounding="nearest", **kw
    )
    assert white["format_version"] == 4 and "calibration" in white
    p, w = ThetaCheckpoint.open(tmp_path / "plain"), ThetaCheckpoint.open(tmp_path / "white")
    for name, info in dense.families.items():
        # the same 4-bit W0; only s and the correction differ
        assert np.array_equal(p.shared(name, 0), w.shared(name, 0))
        for layer, key in enumerate(info.keys):
            W, G = dense.get(key).astype(np.float64), grams[key]

            def out_err(ck, W=W, G=G, layer=layer, name=name):
                D = W - ck.rebuild(name, layer).astype(np.float64)
                return np.sqrt(np.trace(D @ G @ D.T) / np.trace(W @ G @ W.T))

            assert out_err(w) < out_err(p)


def test_without_quant_the_format_is_unchanged(ckpt16, tmp_path):
    manifest = decompose_checkpoint(ckpt16, tmp_path / "t", blocks="layers", rank=4)
    assert manifest["format_version"] == aq.io.UNIFORM_FORMAT_VERSION == 2
    assert not any("quant" in f or "stored_bytes" in f for f in manifest["families"].values())


# -- refusals --------------------------------------------------------------------------------


def test_inner_dimension_not_a_multiple_of_16_is_refused_before_writing(checkpoint, tmp_path):
    with pytest.raises(DecompositionError, match=r"in=24 .* not a multiple of 16"):
        decompose_checkpoint(checkpoint(2), tmp_path / "t", rank=2, quant="nvfp4")
    assert not (tmp_path / "t").exists()
    with pytest.raises(DecompositionError, match="not a multiple of 16"):
        decompose_family(_weights(shape=(8, 24)), rank=1, quant="nvfp4")


def test_unknown_quant_is_refused(ckpt16, tmp_path):
    with pytest.raises(DecompositionError, match="'int4' is not a W0 quantization"):
        decompose_family(_weights(), rank=1, quant="int4")
    # with a budget too (the budget fit with quant= is test_budget_quant.py's)
    with pytest.raises(DecompositionError, match="'int4' is not a W0 quantization"):
        decompose_checkpoint(ckpt16, tmp_path / "t", budget=0.5, quant="int4")
    assert not (tmp_path / "t").exists()


def test_nan_weights_are_refused(tmp_path):
    weights = _weights()
    weights[1][2, 3] = np.nan
    with pytest.raises(DecompositionError, match="layer 1 holds NaN"):
        decompose_family(weights, rank=1, quant="nvfp4")


def test_inconsistent_in_memory_family_is_refused():
    fam, _ = decompose_family(_weights(), blocks="layers", rank=1, quant="nvfp4")
    with pytest.raises(ThetaFormatError, match="one NVFP4 W0 per band"):
        FamilyTheta(
            name="f", shared=fam.shared, bands=fam.bands, layers=fam.layers, nvfp4=fam.nvfp4[:2]
        )


@pytest.fixture
def quant_dir(tmp_path) -> Path:
    fam, _ = decompose_family(
        _weights(), blocks="layers", rank=2, quant="nvfp4", name="mlp.up_proj"
    )
    save_theta(ThetaModel(families={"mlp.up_proj": fam}), tmp_path / "q")
    return tmp_path / "q"


def _rewrite(directory: Path, edit) -> None:
    """Rewrite the checkpoint's tensors through ``edit(dict)`` (float8 needs core's writer)."""
    tensors, _ = read_tensor_directory(directory)
    arrays = {k: tensors.get(k) for k in tensors.keys()}
    edit(arrays)
    for f in directory.glob("*.safetensors"):
        f.unlink()
    (directory / "attnquant.digests.json").unlink(missing_ok=True)
    specs = {k: aq.io.TensorSpec(v.dtype, tuple(v.shape)) for k, v in arrays.items()}
    with PlannedWriter(directory, specs) as writer:
        for k, v in arrays.items():
            writer.write(k, v)


def _manifest(directory: Path, edit) -> None:
    path = directory / "attnquant.json"
    m = json.loads(path.read_text())
    edit(m)
    path.write_text(json.dumps(m))


def test_missing_scale_key_is_refused_naming_it(quant_dir):
    _rewrite(quant_dir, lambda t: t.pop("attnquant.shared.mlp.up_proj.1.W0_scale"))
    with pytest.raises(
        ThetaFormatError,
        match=r"mlp\.up_proj layer 1: attnquant\.shared\.mlp\.up_proj\.1\.W0_scale",
    ) as info:
        ThetaCheckpoint.open(quant_dir)
    assert "\n" not in str(info.value) and not isinstance(info.value, aq.BandMismatchError)


def test_misshapen_packed_w0_is_refused(quant_dir):
    key = "attnquant.shared.mlp.up_proj.0.W0_packed"
    _rewrite(quant_dir, lambda t: t.update({key: t[key][:, :8].copy()}))
    with pytest.raises(
        ThetaFormatError, match=r"W0_packed \(uint8\[24, 8\], expected uint8\[24, 24\]\)"
    ):
        ThetaCheckpoint.open(quant_dir)


def test_nan_scale_is_refused_on_read(quant_dir):
    key = "attnquant.shared.mlp.up_proj.2.W0_scale"

    def poison(t):
        bad = t[key].copy()
        bad.view(np.uint8)[0, 0] = 0x7F  # float8_e4m3fn NaN
        t[key] = bad

    _rewrite(quant_dir, poison)
    ckpt = ThetaCheckpoint.open(quant_dir)
    with pytest.raises(ThetaFormatError, match=r"W0_scale holds NaN/Inf"):
        ckpt.rebuild("mlp.up_proj", 2)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m.update(format_version=3), "has 'quant', which format version 3"),
        (lambda m: m["families"]["mlp.up_proj"].update(quant="int4"), "quant 'int4'"),
        (lambda m: m.update(format_version=5), "newer attnquant.*upgrade attnquant-core"),
    ],
)
def test_bad_quant_manifests_are_refused(quant_dir, edit, message):
    _manifest(quant_dir, edit)
    with pytest.raises(ThetaFormatError, match=message):
        ThetaCheckpoint.open(quant_dir)


def test_a_version_3_reader_refuses_version_4_as_newer(quant_dir, monkeypatch):
    from attnquant_core.io import _manifest

    monkeypatch.setattr(_manifest, "FORMAT_VERSION", 3)
    with pytest.raises(ThetaFormatError, match="format version 4 was written by a newer"):
        ThetaCheckpoint.open(quant_dir)
