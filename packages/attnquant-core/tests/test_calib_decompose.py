"""decompose with calibration statistics: whitened fits lower the output error they promise."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

from attnquant_core import ThetaCheckpoint, decompose_budget, decompose_checkpoint
from attnquant_core.calib import (
    output_error,
    read_stats,
    whitened_svd,
    whitening,
    write_stats,
)
from attnquant_core.fit._whitened import fit_layer_whitened


def _output_errors(theta_dir: Path, state: dict, stats_file: Path) -> tuple[float, float]:
    """Total squared output and weight error of a theta checkpoint over every projection."""
    stats = read_stats(stats_file)
    rebuilt = dict(ThetaCheckpoint.open(theta_dir).rebuilt_state())
    out = weight = 0.0
    for key in stats.keys:
        delta = state[key].astype(np.float64) - rebuilt[key].astype(np.float64)
        out += output_error(delta, stats.gram(key)) ** 2
        weight += float(np.sum(delta**2))
    return out, weight


def test_banded_fit_with_calibration_lowers_the_output_error(tiny_calibrated, tmp_path) -> None:
    directory, stats_file, state = tiny_calibrated
    plain = tmp_path / "plain"
    white = tmp_path / "white"
    decompose_checkpoint(directory, plain, blocks=1, rank=3)
    manifest = decompose_checkpoint(directory, white, blocks=1, rank=3, calibration=stats_file)
    out_plain, w_plain = _output_errors(plain, state, stats_file)
    out_white, w_white = _output_errors(white, state, stats_file)
    assert out_white < 0.9 * out_plain  # what the whitened fit optimises
    assert w_white > w_plain  # and what it gives up for it
    stats = read_stats(stats_file)
    record = manifest["calibration"]
    assert record["digest"] == stats.digest and record["tokens"] == stats.tokens == 128
    assert (record["whitened"], record["unwhitened"]) == (14, 0)
    on_disk = json.loads((white / "attnquant.json").read_text())
    assert on_disk["calibration"] == record
    q = on_disk["families"]["self_attn.q_proj"]
    assert len(q["output_errors"]) == 2 and all(0 < e < 1 for e in q["output_errors"])


def test_a_projection_without_statistics_is_fit_unwhitened(tiny_calibrated, tmp_path) -> None:
    directory, stats_file, _ = tiny_calibrated
    stats = read_stats(stats_file)
    partial = {k: stats.gram(k) for k in stats.keys if "mlp.down_proj" not in k}
    write_stats(tmp_path / "partial.safetensors", partial, tokens=stats.tokens)
    plain = decompose_checkpoint(directory, tmp_path / "plain", blocks=1, rank=2)
    some = decompose_checkpoint(
        directory, tmp_path / "some", blocks=1, rank=2, calibration=tmp_path / "partial.safetensors"
    )
    assert (some["calibration"]["whitened"], some["calibration"]["unwhitened"]) == (12, 2)
    down = some["families"]["mlp.down_proj"]
    assert down["output_errors"] == [None, None]
    assert down["errors"] == plain["families"]["mlp.down_proj"]["errors"]
    assert some["families"]["mlp.up_proj"]["errors"] != plain["families"]["mlp.up_proj"]["errors"]


def test_budget_fit_with_calibration(tiny_calibrated, tmp_path) -> None:
    directory, stats_file, state = tiny_calibrated
    plain = decompose_budget(directory, tmp_path / "plain", budget=0.5)
    white = decompose_budget(directory, tmp_path / "white", budget=0.5, calibration=stats_file)
    assert white.stored <= 0.5 * white.dense and plain.stored <= 0.5 * plain.dense
    out_plain, _ = _output_errors(tmp_path / "plain", state, stats_file)
    out_white, _ = _output_errors(tmp_path / "white", state, stats_file)
    assert out_white < out_plain
    assert white.manifest["calibration"]["digest"] == read_stats(stats_file).digest
    # Calibrated, shared bases sit on the output side only (exact under each layer's gram).
    assert all(c.side in (None, "out") for c in white.families.values())


def test_budget_fit_tries_whitened_shared_bases(tiny_calibrated, tmp_path) -> None:
    directory, stats_file, _ = tiny_calibrated
    report = decompose_budget(
        directory, tmp_path / "shared", budget=0.6, forms=["shared_basis"], calibration=stats_file
    )
    assert {c.form for c in report.families.values()} == {"shared_basis"}
    assert {c.side for c in report.families.values()} == {"out"}
    ThetaCheckpoint.open(tmp_path / "shared")  # a valid theta checkpoint


def test_fit_layer_whitened_low_rank_is_the_whitened_svd() -> None:
    rng = np.random.default_rng(0)
    W = rng.standard_normal((12, 10))
    X = np.diag(np.geomspace(10, 0.1, 10)) @ rng.standard_normal((10, 200))
    white = whitening(X @ X.T, damping=1e-3)
    fit, out_err = fit_layer_whitened(W, None, 4, white, dtype=np.dtype(np.float64))
    U, V, sigma = whitened_svd(W, white, 4)
    np.testing.assert_allclose(fit.theta.U @ fit.theta.V.T, U @ V.T, atol=1e-10)
    assert out_err == pytest.approx(np.sqrt(np.sum(sigma[4:] ** 2) / np.sum(sigma**2)), rel=1e-8)


def test_statistics_of_another_model_are_refused(tiny_calibrated, tmp_path) -> None:
    directory, _, _ = tiny_calibrated
    path = tmp_path / "wrong.safetensors"
    safetensors.numpy.save_file(
        {"model.layers.0.self_attn.q_proj.input_gram": np.eye(7, dtype=np.float32)},
        str(path),
        metadata={"tokens": "7"},
    )
    with pytest.raises(ValueError, match=r"q_proj.input_gram' has shape \[7, 7\] but .* 24 wide"):
        decompose_checkpoint(directory, tmp_path / "out", blocks=1, rank=2, calibration=path)
    assert not (tmp_path / "out").exists()
