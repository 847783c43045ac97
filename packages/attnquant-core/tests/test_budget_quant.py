"""A budget with a 4-bit W0: ``fit_budget`` / ``decompose_budget`` with ``quant="nvfp4"``.

The budget is then counted in bytes for every form (stored bytes over the dense bytes), and a
banded family may store each band's ``W0`` in NVFP4 (4.5 bits a weight), its ranks allocated
on the spectrum of the true post-quantization residual ``W - diag(s) Q(W0)``.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attnquant_core as aq
from attnquant_core import (
    DecompositionError,
    ThetaCheckpoint,
    decompose_budget,
    decompose_checkpoint,
    dequantize_nvfp4,
    fit_budget,
    quantize_nvfp4,
    row_scale,
)
from attnquant_core.calib import DEFAULT_DAMPING, whitening, write_stats
from attnquant_core.testing import SHAPES16, family_weights, make_weights, write_checkpoint

NVFP4_BITS = 4.5


def _nearly_equal(L: int, shape=(64, 96), noise: float = 0.1, seed: int = 0, dtype=np.float32):
    """One family whose layers are one matrix plus a little noise each."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(shape)
    return [(base + noise * rng.standard_normal(shape)).astype(dtype) for _ in range(L)]


def _measured(model, families) -> float:
    """Relative Frobenius error of the fitted model over every weight, in float64."""
    num = den = 0.0
    for name, weights in families.items():
        fam = model.families[name]
        for layer, W in enumerate(weights):
            W = np.asarray(W, np.float64)
            num += float(np.sum((W - fam.reconstruct(layer).astype(np.float64)) ** 2))
            den += float(np.sum(W**2))
    return math.sqrt(num / den)


def _dense_bytes(families) -> int:
    return sum(len(ws) * ws[0].size * ws[0].dtype.itemsize for ws in families.values())


def _check_bytes(model, report, families, budget) -> None:
    """Bytes are the currency: the model's bytes are the report's, within the budget."""
    assert report.currency == "bytes"
    assert report.dense_bytes == _dense_bytes(families)
    assert report.stored_bytes <= math.floor(budget * report.dense_bytes)
    for name, c in report.families.items():
        fam = model.families[name]
        assert c.stored_bytes == fam.stored_bytes(), name  # real bytes, W0 at NVFP4Tensor.nbytes
        assert c.stored == fam.stored_parameters() and fam.ranks == c.ranks
        assert getattr(fam, "quant", None) == c.quant
    assert report.stored_bytes == sum(f.stored_bytes() for f in model.families.values())


# -- what the bytes buy --------------------------------------------------------------------------


def test_nearly_equal_layers_pick_the_nvfp4_form_and_beat_the_float_only_fit():
    """Three nearly equal layers at 0.3: a float W0 alone costs a third of the family, so the
    float forms fall back to a shared basis; a 4-bit W0 costs 4.5/32 of a layer and leaves
    room for corrections."""
    families = {"mlp.up_proj": _nearly_equal(3)}
    floats, float_report = fit_budget(families, 0.3)
    model, report = fit_budget(families, 0.3, quant="nvfp4")
    _check_bytes(model, report, families, 0.3)
    choice = report.families["mlp.up_proj"]
    assert choice.quant == "nvfp4" and choice.form == "banded", choice.label
    assert float_report.families["mlp.up_proj"].quant is None
    assert _measured(model, families) < 0.5 * _measured(floats, families)
    assert report.measured_error == pytest.approx(_measured(model, families), rel=1e-4)


def test_the_quantized_candidate_predicts_its_measured_error_exactly():
    """Only the passthrough NVFP4 candidate allowed: its predicted error is the energy of the
    exact SVD tail of each layer's residual W - diag(s) Q(W), which the fit then achieves."""
    families = {"a": _nearly_equal(3, (40, 64), seed=1), "b": _nearly_equal(3, (24, 32), seed=2)}
    model, report = fit_budget(families, 0.35, forms=("banded",), banded_blocks=(), quant="nvfp4")
    _check_bytes(model, report, families, 0.35)
    for name, c in report.families.items():
        assert (c.form, c.blocks, c.quant) == ("banded", 3, "nvfp4")
        tail = 0.0
        for W, r in zip(families[name], c.ranks, strict=True):
            W0 = dequantize_nvfp4(quantize_nvfp4(W))  # the reference quantizer, from scratch
            s = row_scale(W, W0).astype(np.float32).astype(np.float64)
            R = W.astype(np.float64) - s[:, None] * W0
            S = np.linalg.svd(R, compute_uv=False)
            tail += float(np.sum(S[r:] ** 2))
        assert c.error2 == pytest.approx(tail, rel=1e-5)
        fam = model.families[name]
        num = sum(
            float(np.sum((W.astype(np.float64) - fam.reconstruct(i)) ** 2))
            for i, W in enumerate(families[name])
        )
        assert c.measured_error == pytest.approx(math.sqrt(num / c.norm2), rel=1e-4)
        assert c.measured_error == pytest.approx(c.error, rel=1e-4)
        assert max(c.ranks) > 0  # the budget bought corrections


def test_the_budget_is_used_within_one_rank_step():
    families = family_weights(make_weights(4, shapes=SHAPES16, seed=3))
    for budget in (0.2, 0.3, 0.5):
        model, report = fit_budget(families, budget, quant="nvfp4")
        _check_bytes(model, report, families, budget)
        left = math.floor(budget * report.dense_bytes) - report.stored_bytes
        step = max(int(c.candidate.unit_cost.max()) for c in report.families.values())
        full = all(max(c.ranks) == min(families[n][0].shape) for n, c in report.families.items())
        assert full or 0 <= left < step, (budget, left, step)


def test_never_worse_than_the_float_forms_alone():
    """Same storage dtype as the source: bytes are parameters times 4, so the float-only fit is
    a point of the quantized fit's search, and the answer is at least as good."""
    families = family_weights(make_weights(4, shapes=SHAPES16, seed=5))
    for budget in (0.15, 0.3, 0.6):
        _, floats = fit_budget(families, budget)
        _, mixed = fit_budget(families, budget, quant="nvfp4")
        assert mixed.error <= floats.error + 1e-12
        assert mixed.baseline_error == pytest.approx(floats.baseline_error, rel=1e-12)


def test_a_budget_below_the_nvfp4_w0_falls_back_or_names_the_smallest_feasible_budget():
    families = {"f": _nearly_equal(1, (32, 64))}
    dense = _dense_bytes(families)
    nvfp4_alone = 32 * 64 // 2 + 32 * 4 + 4 + 32 * 4  # codes, E4M3 scales, global scale, s
    budget = 0.5 * nvfp4_alone / dense
    model, report = fit_budget(families, budget, quant="nvfp4")  # low rank takes over
    _check_bytes(model, report, families, budget)
    assert report.families["f"].form == "lowrank"
    with pytest.raises(DecompositionError) as info:
        fit_budget(families, budget, forms=("banded",), quant="nvfp4")
    message = str(info.value)
    assert "\n" not in message and "bytes" in message
    smallest = float(re.search(r"smallest budget these forms fit in is ([0-9.]+)", message)[1])
    assert smallest == pytest.approx(nvfp4_alone / dense, abs=1e-4)
    _, fits = fit_budget(families, smallest, forms=("banded",), quant="nvfp4")  # it does fit
    assert fits.families["f"].quant == "nvfp4"
    with pytest.raises(DecompositionError, match="smallest budget"):
        fit_budget(families, smallest - 1e-4, forms=("banded",), quant="nvfp4")


# -- shapes, budgets, dtypes -----------------------------------------------------------------


@st.composite
def quant_models(draw):
    L = draw(st.integers(1, 4))
    dtype = draw(st.sampled_from([np.float32, np.float64, ml_dtypes.bfloat16]))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    families = {}
    for f in range(draw(st.integers(1, 3))):
        shape = (draw(st.integers(1, 24)), 16 * draw(st.integers(1, 3)))
        base = rng.standard_normal(shape)
        mix = draw(st.floats(0.0, 1.0))
        families[f"f{f}"] = [
            (mix * base + 0.3 * rng.standard_normal(shape)).astype(dtype) for _ in range(L)
        ]
    return families, draw(st.floats(0.02, 1.0)), np.dtype(dtype)


@settings(max_examples=25, deadline=None)
@given(quant_models())
def test_property_bytes_within_budget_and_errors_as_predicted(case):
    families, budget, dtype = case
    model, report = fit_budget(families, budget, quant="nvfp4")
    _check_bytes(model, report, families, budget)
    assert report.error <= report.baseline_error + 1e-12
    # bf16: s, U and V are rounded to 8 mantissa bits after the (float32) prediction
    tol = {np.dtype(np.float64): 1e-9, np.dtype(np.float32): 2e-4}.get(dtype, 2e-2)
    assert _measured(model, families) == pytest.approx(report.error, rel=tol, abs=tol)


@settings(max_examples=10, deadline=None)
@given(in_dim=st.integers(1, 80).filter(lambda n: n % 16), budget=st.floats(0.05, 1.0))
def test_property_an_input_dim_not_a_multiple_of_16_is_refused_in_one_line(in_dim, budget):
    families = {"ok": _nearly_equal(2, (8, 32)), "mlp.down_proj": _nearly_equal(2, (8, in_dim))}
    with pytest.raises(DecompositionError) as info:
        fit_budget(families, budget, quant="nvfp4")
    message = str(info.value)
    assert "\n" not in message and "mlp.down_proj" in message
    assert f"in={in_dim}" in message and "multiple of 16" in message


# -- the checkpoint path -------------------------------------------------------------------------


@pytest.fixture
def ckpt16(tmp_path) -> Path:
    return write_checkpoint(tmp_path / "dense", make_weights(3, shapes=SHAPES16, seed=4))


def _projection_file_bytes(ckpt: ThetaCheckpoint, name: str) -> int:
    return sum(
        ckpt.tensors.spec(k).nbytes
        for k in ckpt.tensors.keys()
        if k.startswith(f"attnquant.shared.{name}.") or f".{name}.theta_" in k
    )


@pytest.mark.parametrize("budget", [0.2, 0.3, 0.5])
def test_decompose_writes_what_fit_budget_fits_within_the_bytes(ckpt16, tmp_path, budget):
    out = tmp_path / "theta"
    manifest = decompose_checkpoint(ckpt16, out, budget=budget, quant="nvfp4")
    ckpt = ThetaCheckpoint.open(out)
    dense = aq.open_checkpoint(ckpt16)
    families = {n: [dense.get(k) for k in info.keys] for n, info in dense.families.items()}
    model, report = fit_budget(families, budget, quant="nvfp4")
    summary = manifest["budget"]
    assert summary["currency"] == "bytes" and summary["stored_bytes"] == report.stored_bytes
    assert summary["stored_bytes"] <= budget * summary["dense_bytes"]
    assert summary["dense_bytes"] == _dense_bytes(families)
    quantized = False
    on_disk = 0
    for name, fam in model.families.items():
        entry = manifest["families"][name]
        c = report.families[name]
        assert (entry["form"], entry.get("quant"), entry["ranks"]) == (
            c.form,
            c.quant,
            list(c.ranks),
        )
        assert entry["stored_bytes"] == c.stored_bytes == _projection_file_bytes(ckpt, name)
        assert entry["stored_parameters"] == c.stored
        on_disk += entry["stored_bytes"]
        quantized |= c.quant is not None
        for layer, W in enumerate(families[name]):
            assert np.array_equal(ckpt.rebuild(name, layer), fam.reconstruct(layer).astype(W.dtype))
    assert on_disk <= budget * summary["dense_bytes"]
    assert quantized and manifest["format_version"] == 4
    assert len(dict(ckpt.rebuilt_state())) == len(ckpt.stock_keys())


def test_calibrated_quantized_candidate_predicts_the_output_error(ckpt16, tmp_path):
    """With statistics, each family's predicted error is its (energy-scaled) output error:
    the fit of the whitened post-quantization residual achieves it."""
    dense = aq.open_checkpoint(ckpt16)
    rng = np.random.default_rng(7)
    grams = {}
    for info in dense.families.values():
        for key in info.keys:
            X = (
                rng.standard_normal((info.shape[1], 200))
                * np.geomspace(5, 0.2, info.shape[1])[:, None]
            )
            grams[key] = X @ X.T
    stats = write_stats(tmp_path / "s.safetensors", grams, tokens=200)
    report = decompose_budget(
        ckpt16,
        tmp_path / "t",
        budget=0.3,
        forms=("banded",),
        banded_blocks=(),
        quant="nvfp4",
        calibration=stats,
    )
    ckpt = ThetaCheckpoint.open(tmp_path / "t")
    for name, info in dense.families.items():
        c = report.families[name]
        assert c.quant == "nvfp4" and c.blocks == info.num_layers
        err2 = 0.0
        for layer, key in enumerate(info.keys):
            W = dense.get(key).astype(np.float64)
            white = whitening(grams[key], damping=DEFAULT_DAMPING)
            scale = np.linalg.norm(W) / np.linalg.norm(white.whiten(W))
            diff = W - ckpt.rebuild(name, layer).astype(np.float64)
            err2 += scale**2 * float(np.sum(white.whiten(diff) ** 2))
        assert c.error2 == pytest.approx(err2, rel=1e-3)
    assert ckpt.manifest["calibration"]["whitened"] == sum(
        i.num_layers for i in dense.families.values()
    )


def test_float_families_in_a_byte_budget_record_their_bytes(ckpt16, tmp_path):
    manifest = decompose_checkpoint(ckpt16, tmp_path / "t", budget=0.9, quant="nvfp4")
    for entry in manifest["families"].values():
        if entry.get("quant") is None:  # a float form: every number at its dtype
            assert entry["stored_bytes"] == entry["stored_parameters"] * 4


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"quant": "int4"}, "'int4' is not a W0 quantization"),
        ({"quant": "nvfp4", "budget": 1.5}, r"budget=1\.5 is outside"),
        ({"quant": "nvfp4", "rank": 2}, "either budget= or blocks=/rank="),
    ],
)
def test_bad_arguments_get_one_line_and_write_nothing(ckpt16, tmp_path, kwargs, message):
    kwargs = {"budget": 0.3, **kwargs}
    with pytest.raises(DecompositionError, match=message) as info:
        decompose_checkpoint(ckpt16, tmp_path / "t", **kwargs)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "t").exists()


def test_an_input_dim_not_a_multiple_of_16_writes_nothing(tmp_path):
    src = write_checkpoint(tmp_path / "src", make_weights(2))  # hidden 24
    with pytest.raises(DecompositionError, match=r"in=24 .* not a multiple of 16"):
        decompose_checkpoint(src, tmp_path / "t", budget=0.3, quant="nvfp4")
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_nan_weights_are_refused_and_write_nothing(tmp_path):
    tensors = make_weights(2, shapes=SHAPES16)
    tensors["model.layers.1.mlp.up_proj.weight"][3, 4] = np.nan
    src = write_checkpoint(tmp_path / "src", tensors)
    with pytest.raises(aq.CheckpointError, match=r"layers\.1\.mlp\.up_proj\.weight holds 1 NaN"):
        decompose_checkpoint(src, tmp_path / "t", budget=0.3, quant="nvfp4")
    assert sorted(os.listdir(tmp_path)) == ["src"]
