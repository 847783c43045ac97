"""GPTQ's rounding of a 4-bit ``W0`` for the output error (``decompose --rounding gptq``).

Checked against round to nearest (byte-identical where no error can move: a diagonal gram),
against a plain column-by-column GPTQ written from the paper's definition (no lazy batches),
and by what it is for: a lower ``||(W - Q) X||`` than round to nearest on correlated inputs.
"""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
import scipy.linalg
from hypothesis import given, settings
from hypothesis import strategies as st

import attnquant_core as aq
from attnquant_core import (
    DecompositionError,
    NVFP4Error,
    ThetaCheckpoint,
    decompose_checkpoint,
    dequantize_nvfp4,
    gptq_nvfp4,
    quantize_nvfp4,
)
from attnquant_core.calib import write_stats
from attnquant_core.fit._gptq import search_block_scales
from attnquant_core.forms._nvfp4 import E2M1_VALUES, E4M3_MAX, E4M3_MIN_SUBNORMAL
from attnquant_core.testing import SHAPES16, make_weights, write_checkpoint


def _bytes(q) -> tuple[bytes, bytes, bytes]:
    return tuple(np.asarray(a).tobytes() for a in (q.weight, q.weight_scale, q.weight_scale_2))


def _correlated_gram(n: int, seed: int, tokens: int = 512, damped: bool = True) -> np.ndarray:
    """The gram of inputs with skewed, correlated channels (as real activations are), damped
    as the fits damp it (1% of its mean diagonal) unless ``damped`` is False."""
    rng = np.random.default_rng(seed)
    mix = rng.standard_normal((n, n)) * np.logspace(0, -2, n)
    X = mix @ rng.standard_normal((n, tokens)) + 3.0 * rng.standard_normal((n, 1))
    G = X @ X.T
    return G + 1e-2 * np.mean(np.diag(G)) * np.eye(n) if damped else G


def _out_err(W: np.ndarray, q, G: np.ndarray) -> float:
    D = W.astype(np.float64) - dequantize_nvfp4(q).astype(np.float64)
    return float(np.sqrt(np.trace(D @ G @ D.T)))


def _reference_gptq(
    W: np.ndarray, G: np.ndarray, search: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """GPTQ from its definition: each column rounded in turn, its error moved onto every later
    column at once through ``U`` (``U^T U = G^{-1}``); each 16-block's E4M3 scale from the block
    as it stands when reached (its largest value, or with ``search`` the scale search weighted
    by ``1 / U[c, c]^2``). Returns the codes' values and the per-block steps."""
    W = W.astype(np.float64).copy()
    out_dim, n = W.shape
    U = scipy.linalg.cholesky(np.linalg.inv(G), lower=False)
    scale_2 = np.float32(np.max(np.abs(W.astype(np.float32))) / np.float32(6 * 448))
    Q = np.zeros_like(W)
    steps = np.zeros((out_dim, n // 16), np.float32)
    for j in range(n):
        if j % 16 == 0 and search:
            importance = 1.0 / np.diag(U)[j : j + 16] ** 2
            e4m3 = search_block_scales(W[:, j : j + 16].astype(np.float32), scale_2, importance)
            steps[:, j // 16] = e4m3.astype(np.float32) * scale_2
        elif j % 16 == 0:
            amax = np.abs(W[:, j : j + 16].astype(np.float32)).max(axis=1)
            raw = amax / (np.float32(6) * scale_2)
            raw = np.clip(np.where(raw == 0, 1, raw), E4M3_MIN_SUBNORMAL, E4M3_MAX)
            e4m3 = raw.astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
            steps[:, j // 16] = e4m3 * scale_2
        step = steps[:, j // 16]
        x = W[:, j].astype(np.float32) / step
        # nearest E2M1 magnitude (ties to even code), sign kept
        mags = E2M1_VALUES[:8]
        a = np.abs(x)[:, None]
        d = np.abs(a - mags[None, :])
        idx = np.argmin(d + 1e-9 * (np.arange(8) % 2)[None, :], axis=1)
        q = (np.sign(x) * mags[idx]).astype(np.float32) * step
        Q[:, j] = q
        err = (W[:, j] - q) / U[j, j]
        W[:, j:] -= np.outer(err, U[j, j:])
    return Q, steps


# -- the rounding ----------------------------------------------------------------------------


@st.composite
def diagonal_cases(draw: st.DrawFn, tailed: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """A weight ``[out, 16k]`` (scaled by ``exp(spread)``; with ``tailed`` its columns' scales
    spread too, so some blocks hold outliers) and a positive diagonal for its gram."""
    out_dim, blocks = draw(st.integers(1, 9)), draw(st.integers(1, 5))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    spread, tail = draw(st.floats(0.0, 4.0)), draw(st.floats(0.0, 3.0)) if tailed else 0.0
    W = rng.standard_normal((out_dim, 16 * blocks))
    W *= np.exp(tail * rng.standard_normal((1, 16 * blocks)) + spread * rng.standard_normal())
    return W.astype(np.float32), np.exp(spread * rng.uniform(-1, 1, 16 * blocks))


@settings(max_examples=30, deadline=None)
@given(case=diagonal_cases())
def test_a_diagonal_gram_moves_no_error_so_gptq_is_round_to_nearest_bit_for_bit(case):
    W, d = case
    assert _bytes(gptq_nvfp4(W, np.diag(d), scale_search=False)) == _bytes(quantize_nvfp4(W))


def _block_errors(W: np.ndarray, q, importance: np.ndarray) -> np.ndarray:
    """Each (row, 16-block)'s squared error weighted by its columns' ``importance``."""
    D2 = (W.astype(np.float64) - dequantize_nvfp4(q).astype(np.float64)) ** 2 * importance
    return D2.reshape(W.shape[0], -1, 16).sum(axis=-1)


@settings(max_examples=30, deadline=None)
@given(case=diagonal_cases(tailed=True))
def test_the_scale_search_never_loses_to_round_to_nearest_where_no_error_moves(case):
    """A diagonal gram: every row-block's error, weighted by the diagonal (the importance the
    search weighs by), is at most round to nearest's, which is always among its candidates."""
    W, d = case
    searched = _block_errors(W, gptq_nvfp4(W, np.diag(d)), d)
    nearest = _block_errors(W, quantize_nvfp4(W), d)
    assert np.all(searched <= nearest * (1 + 1e-12) + 1e-300)


def test_the_scale_search_lowers_the_weighted_error_of_heavy_tailed_blocks():
    rng = np.random.default_rng(3)
    W = (rng.standard_t(3, (64, 256))).astype(np.float32)
    d = np.exp(rng.uniform(-1, 1, 256))
    searched = _block_errors(W, gptq_nvfp4(W, np.diag(d)), d).sum()
    nearest = _block_errors(W, quantize_nvfp4(W), d).sum()
    assert searched < 0.95 * nearest


@pytest.mark.parametrize("search", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gptq_matches_the_column_by_column_definition(seed, search):
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((12, 64)).astype(np.float32)
    G = _correlated_gram(64, seed)
    Q_ref, steps_ref = _reference_gptq(W, G, search)
    q = gptq_nvfp4(W, G, batch=32, scale_search=search)  # two lazy batches exercised
    got = dequantize_nvfp4(q).astype(np.float64)
    steps = q.weight_scale.astype(np.float32) * q.weight_scale_2
    assert np.array_equal(steps, steps_ref)
    # The batched update reorders float64 sums only: at most a rare tie may round otherwise.
    assert np.mean(got == Q_ref) > 0.99
    assert _out_err(W, q, G) == pytest.approx(
        np.sqrt(np.trace((W - Q_ref) @ G @ (W - Q_ref).T)), rel=1e-3
    )


@pytest.mark.parametrize("batch", [16, 48, 128])
def test_the_lazy_batch_size_changes_only_rounding(batch):
    W = np.random.default_rng(5).standard_normal((20, 96)).astype(np.float32)
    G = _correlated_gram(96, 5)
    a, b = gptq_nvfp4(W, G, batch=batch), gptq_nvfp4(W, G, batch=16)
    assert np.mean(dequantize_nvfp4(a) == dequantize_nvfp4(b)) > 0.99


@pytest.mark.parametrize("seed", range(4))
def test_gptq_lowers_the_output_error_on_correlated_inputs(seed):
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((32, 128)).astype(np.float32)
    G = _correlated_gram(128, seed)
    rtn, gptq = _out_err(W, quantize_nvfp4(W), G), _out_err(W, gptq_nvfp4(W, G), G)
    assert gptq < 0.8 * rtn


def test_gptq_writes_valid_nvfp4():
    W = np.random.default_rng(9).standard_normal((8, 64)).astype(np.float32) * 30
    q = gptq_nvfp4(W, _correlated_gram(64, 9))
    assert q.weight.dtype == np.uint8 and q.weight.shape == (8, 32)
    assert q.weight_scale.shape == (8, 4) and np.isfinite(q.weight_scale.astype(np.float32)).all()
    assert np.isfinite(dequantize_nvfp4(q)).all()
    assert q.weight_scale_2 == quantize_nvfp4(W).weight_scale_2  # the tensor's own amax


def test_bad_grams_and_batches_are_refused_with_one_line_naming_the_weight():
    W = np.ones((4, 32), np.float32)
    with pytest.raises(NVFP4Error, match=r"^w: gram has shape \(16, 16\); expected \(32, 32\)$"):
        gptq_nvfp4(W, np.eye(16), name="w")
    with pytest.raises(NVFP4Error, match=r"^w gram: not positive definite"):
        gptq_nvfp4(W, -np.eye(32), name="w")
    with pytest.raises(ValueError, match="multiple of 16"):
        gptq_nvfp4(W, np.eye(32), batch=24)
    with pytest.raises(NVFP4Error, match="multiple of 16"):
        gptq_nvfp4(np.ones((4, 24), np.float32), np.eye(24))


# -- in decompose ----------------------------------------------------------------------------

L = 3


@pytest.fixture
def calibrated(tmp_path):
    ckpt = write_checkpoint(tmp_path / "dense", make_weights(L, shapes=SHAPES16))
    dense = aq.open_checkpoint(ckpt)
    grams = {}
    for i, info in enumerate(dense.families.values()):
        for layer, key in enumerate(info.keys):
            grams[key] = _correlated_gram(info.shape[1], 100 * i + layer, damped=False)
    return ckpt, dense, grams, write_stats(tmp_path / "stats.safetensors", grams, tokens=512)


def test_decompose_with_statistics_rounds_by_gptq_and_records_it(calibrated, tmp_path):
    ckpt, dense, grams, stats = calibrated
    kw = {"blocks": "layers", "rank": 0, "quant": "nvfp4", "calibration": stats}
    gptq = decompose_checkpoint(ckpt, tmp_path / "gptq", **kw)
    near = decompose_checkpoint(ckpt, tmp_path / "near", rounding="nearest", **kw)
    assert all(f["rounding"] == "gptq" for f in gptq["families"].values())
    assert not any("rounding" in f for f in near["families"].values())
    g, n = ThetaCheckpoint.open(tmp_path / "gptq"), ThetaCheckpoint.open(tmp_path / "near")
    for name, info in dense.families.items():
        for layer, key in enumerate(info.keys):
            W = dense.get(key)
            # nearest: the reference NVFP4 of the weight, bit for bit
            assert np.array_equal(n.shared(name, layer), dequantize_nvfp4(quantize_nvfp4(W)))
            # gptq: the very codes gptq_nvfp4 chooses for the layer's damped gram
            white = aq.calib.whitening(grams[key])
            ref = dequantize_nvfp4(gptq_nvfp4(W, white.gram()))
            assert np.array_equal(g.shared(name, layer), ref)
        mean = lambda f, name=name: float(np.mean(f["families"][name]["output_errors"]))  # noqa: E731
        assert mean(gptq) < mean(near)


def test_without_statistics_rounding_changes_nothing(calibrated, tmp_path):
    ckpt, *_ = calibrated
    kw = {"blocks": "layers", "rank": 2, "quant": "nvfp4"}
    decompose_checkpoint(ckpt, tmp_path / "a", **kw)
    decompose_checkpoint(ckpt, tmp_path / "b", rounding="nearest", **kw)
    for f in ("model.safetensors",):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()
    manifest = json.loads((tmp_path / "a" / "attnquant.json").read_text())
    assert not any("rounding" in f for f in manifest["families"].values())


def test_a_budget_with_quant_and_statistics_rounds_by_gptq(calibrated, tmp_path):
    ckpt, _, _, stats = calibrated
    report = aq.decompose_budget(
        ckpt, tmp_path / "b", budget=0.3, quant="nvfp4", calibration=stats, forms=("banded",)
    )
    families = report.manifest["families"]
    quantized = [f for f in families.values() if f.get("quant")]
    assert quantized and all(f["rounding"] == "gptq" for f in quantized)
    again = aq.decompose_budget(
        ckpt,
        tmp_path / "n",
        budget=0.3,
        quant="nvfp4",
        calibration=stats,
        forms=("banded",),
        rounding="nearest",
    )
    assert not any("rounding" in f for f in again.manifest["families"].values())


def test_unknown_rounding_is_refused_before_writing(calibrated, tmp_path):
    ckpt, *_ = calibrated
    with pytest.raises(DecompositionError, match="rounding='stochastic' is not a W0 rounding"):
        decompose_checkpoint(ckpt, tmp_path / "x", quant="nvfp4", rounding="stochastic")
    assert not (tmp_path / "x").exists()
