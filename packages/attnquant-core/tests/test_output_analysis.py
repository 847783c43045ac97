"""The output error in analyze, the sweep and the budget frontier, against brute force on X."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

from attnquant_core import (
    DecompositionError,
    ThetaCheckpoint,
    analyze_checkpoint,
    budget_frontier,
    decompose_budget,
    decompose_checkpoint,
    open_checkpoint,
    sweep,
)
from attnquant_core.calib import gram_key, whitened_svd, whitening
from attnquant_core.fit._whitened import as_calibration


def _inputs(key: str, width: int) -> np.ndarray:
    """A projection's calibration inputs ``X [in, T]``: few tokens, very uneven channels, so the
    gram is far from a multiple of I (fixed per key)."""
    rng = np.random.default_rng(sum(key.encode()))
    scales = np.logspace(-2, 1, width)[rng.permutation(width)]
    return scales[:, None] * rng.standard_normal((width, 3 * width))


@pytest.fixture
def setup(checkpoint, tmp_path) -> tuple[Path, Path, dict[str, np.ndarray]]:
    """A 4-layer checkpoint, its statistics (every projection) and the inputs behind them."""
    src = checkpoint(4)
    ckpt = open_checkpoint(src)
    X = {
        k: _inputs(k, ckpt.families[f].shape[1])
        for f in ckpt.families
        for k in ckpt.families[f].keys
    }
    stats = tmp_path / "stats.safetensors"
    grams = {gram_key(k): x @ x.T for k, x in X.items()}
    safetensors.numpy.save_file(grams, str(stats), metadata={"tokens": "96"})
    return src, stats, X


def _damped(X: np.ndarray, damping: float) -> np.ndarray:
    """``X'`` with ``X' X'^T = X X^T + delta I``: the inputs the damped gram stands for."""
    G = X @ X.T
    delta = damping * float(np.mean(np.diagonal(G)))
    return np.concatenate([X, np.sqrt(delta) * np.eye(len(X))], axis=1)


def _brute(pairs, X: dict[str, np.ndarray], damping: float) -> float:
    """``||(W - W_hat) X||/||W X||`` per layer, pooled by ``||W||^2``, straight from X."""
    num = den = 0.0
    for key, W, W_hat in pairs:
        Xd = _damped(X[key], damping)
        W = W.astype(np.float64)
        e = np.linalg.norm((W - W_hat.astype(np.float64)) @ Xd) / np.linalg.norm(W @ Xd)
        num += e**2 * np.sum(W**2)
        den += np.sum(W**2)
    return float(np.sqrt(num / den))


@pytest.mark.parametrize("damping", [0.0, 1e-2])
def test_analyze_output_error_is_the_brute_force_one(setup, tmp_path, damping):
    src, stats, X = setup
    ckpt = open_checkpoint(src)
    cal = as_calibration(stats, damping)
    report = analyze_checkpoint(ckpt, blocks=2, rank=3, calibration=cal)
    # The same whitened fit, written by decompose --calibration and rebuilt.
    out = tmp_path / f"theta{damping}"
    decompose_checkpoint(src, out, blocks=2, rank=3, calibration=cal)
    rebuilt = dict(ThetaCheckpoint.open(out).rebuilt_state())
    for name, info in ckpt.families.items():
        pairs = [(k, ckpt.get(k), rebuilt[k]) for k in info.keys]
        fam = report.families[name]
        assert fam.output_error == pytest.approx(_brute(pairs, X, damping), rel=1e-5)
        assert fam.output_error < fam.error  # whitened: the error sits where inputs are small
    everything = [(k, ckpt.get(k), rebuilt[k]) for i in ckpt.families.values() for k in i.keys]
    assert report.output_error == pytest.approx(_brute(everything, X, damping), rel=1e-5)
    assert report.to_json()["calibration"]["families_weight_error_only"] == []


def test_sweep_predicts_the_fitted_output_error(setup):
    src, stats, X = setup
    ckpt = open_checkpoint(src)
    result = sweep(ckpt, blocks=[1, 2], ranks=[0, 2, 5], calibration=stats)
    for G in (1, 2):
        for r in (0, 2, 5):
            report = analyze_checkpoint(ckpt, blocks=G, rank=r, calibration=stats)
            total = next(p for p in result.totals() if (p.blocks, p.rank) == (G, r))
            assert total.output_error == pytest.approx(report.output_error, rel=1e-4)
            for name, fam in report.families.items():
                point = next(
                    p for p in result.points if (p.family, p.blocks, p.rank) == (name, G, r)
                )
                assert point.output_error == pytest.approx(fam.output_error, rel=1e-4)
                # Per-layer SVD fit for the output error (SVD-LLM) at the point's rank k: the
                # spectrum's prediction is the error of the fit itself.
                pairs = []
                for key in ckpt.families[name].keys:
                    W = ckpt.get(key).astype(np.float64)
                    U, V, _ = whitened_svd(W, whitening(X[key] @ X[key].T), point.svd_rank)
                    pairs.append((key, W, U @ V.T))
                assert point.svd_output_error == pytest.approx(
                    _brute(pairs, X, 1e-2), rel=1e-6, abs=1e-7
                )
    curve = result.svd_output_curve
    assert [c["rank"] for c in curve] == [c["rank"] for c in result.svd_curve]
    errors = [c["output_error"] for c in curve]
    assert errors == sorted(errors, reverse=True) and errors[-1] == pytest.approx(0.0, abs=1e-6)


def test_families_without_statistics_get_the_weight_error_only(setup, tmp_path):
    src, stats, _ = setup
    ckpt = open_checkpoint(src)
    grams = safetensors.numpy.load_file(str(stats))
    v = ckpt.families["self_attn.v_proj"].keys
    k0 = ckpt.families["self_attn.k_proj"].keys[0]
    for key in [*v, k0]:
        del grams[gram_key(key)]
    partial = tmp_path / "partial.safetensors"
    safetensors.numpy.save_file(grams, str(partial), metadata={"tokens": "96"})

    result = sweep(ckpt, blocks=[1], ranks=[2], calibration=partial)
    record = result.calibration
    assert record is not None
    assert set(record["families_weight_error_only"]) == {"self_attn.v_proj", "self_attn.k_proj"}
    assert record["partially_covered"] == ["self_attn.k_proj"]
    assert "weight error only" in record["note"]
    by_family = {p.family: p for p in result.points}
    for name in ("self_attn.v_proj", "self_attn.k_proj"):
        assert by_family[name].output_error is None and by_family[name].svd_output_error is None
        assert by_family[name].error > 0
    # The total's output error is over the families that have one.
    full = sweep(ckpt, blocks=[1], ranks=[2], calibration=stats)
    norm2 = {
        n: sum(float(np.sum(ckpt.get(k).astype(np.float64) ** 2)) for k in i.keys)
        for n, i in ckpt.families.items()
    }
    kept = [
        p
        for p in full.points
        if p.family in norm2 and p.family not in {"self_attn.v_proj", "self_attn.k_proj"}
    ]
    expect = np.sqrt(
        sum(p.output_error**2 * norm2[p.family] for p in kept) / sum(norm2[p.family] for p in kept)
    )
    assert by_family["total"].output_error == pytest.approx(expect, rel=1e-9)

    report = analyze_checkpoint(ckpt, blocks=1, rank=2, calibration=partial)
    assert report.families["self_attn.v_proj"].output_error is None
    assert report.families["self_attn.k_proj"].output_error is None  # partly whitened
    assert report.families["self_attn.q_proj"].output_error is not None

    (point,) = budget_frontier(ckpt, [0.5], calibration=partial)
    assert point.objective == "output"
    assert "self_attn.v_proj" not in point.family_errors
    assert set(point.forms) == set(ckpt.families)  # every family is still allocated

    empty = tmp_path / "other.safetensors"
    safetensors.numpy.save_file(
        {"model.layers.0.other.input_gram": np.eye(3)}, str(empty), metadata={"tokens": "1"}
    )
    with pytest.raises(DecompositionError, match="another model") as info:
        sweep(ckpt, blocks=[1], ranks=[2], calibration=empty)
    assert "\n" not in str(info.value)


def test_frontier_output_error_is_what_decompose_budget_fits(setup, tmp_path):
    src, stats, X = setup
    ckpt = open_checkpoint(src)
    points = budget_frontier(ckpt, [0.3, 0.6], forms=["lowrank"], calibration=stats)
    weight = budget_frontier(ckpt, [0.3, 0.6], forms=["lowrank"])
    for point, plain in zip(points, weight, strict=True):
        assert point.objective == "output" and plain.objective == "weight"
        out = tmp_path / f"b{point.budget}"
        decompose_budget(src, out, budget=point.budget, forms=["lowrank"], calibration=stats)
        rebuilt = dict(ThetaCheckpoint.open(out).rebuilt_state())
        pairs = [(k, ckpt.get(k), rebuilt[k]) for i in ckpt.families.values() for k in i.keys]
        assert point.error == pytest.approx(_brute(pairs, X, 1e-2), rel=1e-4)
        assert point.baseline_error == pytest.approx(point.error)  # lowrank only: the baseline
        assert set(point.family_errors) == set(ckpt.families)
        assert point.to_json()["objective"] == "output"
