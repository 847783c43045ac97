"""``attnquant analyze --calibration``: the output error in the JSON, CSV and plot (read as data,
never from the table, whose layout depends on the terminal)."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import safetensors.numpy

from attnquant_cli import cli
from attnquant_cli._analyze import CSV_FIELDS
from attnquant_core import open_checkpoint
from attnquant_core.calib import gram_key
from attnquant_core.testing import make_weights, write_checkpoint


@pytest.fixture
def src(tmp_path):
    return write_checkpoint(tmp_path / "src", make_weights(4))


@pytest.fixture
def stats(src, tmp_path):
    """Hand-written statistics of every projection but v_proj (uneven input channels)."""
    rng = np.random.default_rng(0)
    grams = {}
    for name, info in open_checkpoint(src).families.items():
        if name.endswith("v_proj"):
            continue
        for key in info.keys:
            width = info.shape[1]
            X = np.logspace(-2, 1, width)[:, None] * rng.standard_normal((width, 2 * width))
            grams[gram_key(key)] = (X @ X.T).astype(np.float32)
    path = tmp_path / "stats.safetensors"
    safetensors.numpy.save_file(grams, str(path), metadata={"tokens": str(8)})
    return path


def test_analyze_with_calibration_adds_the_output_error(src, stats, tmp_path):
    out = tmp_path / "an"
    args = ["analyze", str(src), "--blocks", "1,2", "--rank", "0,4", "--budget", "0.3,0.6"]
    assert cli([*args, "--calibration", str(stats), "-o", str(out)]) == 0
    data = json.loads((out / "analyze.json").read_text())
    record = data["calibration"]
    assert "weight error only" in record["note"]
    assert record["tokens"] == 8 and record["digest"].startswith("sha256:")
    assert record["families_weight_error_only"] == ["self_attn.v_proj"]
    for p in data["points"]:
        if p["family"] == "self_attn.v_proj":
            assert p["output_error"] is None and p["svd_output_error"] is None
        else:
            assert 0 <= p["output_error"] <= 1 and 0 <= p["svd_output_error"] <= 1
    # Fit for the output error, the output error is far below the weight error here.
    totals = [p for p in data["points"] if p["family"] == "total" and p["rank"] == 4]
    assert all(p["output_error"] < p["error"] for p in totals)
    assert "output_error" in data["svd_output_curve"][0]
    weight, output = data["budget_frontier"], data["budget_frontier_output"]
    assert [p["objective"] for p in weight] == ["weight", "weight"]
    assert [p["objective"] for p in output] == ["output", "output"]
    assert "self_attn.v_proj" not in output[0]["family_errors"]
    assert output[0]["error"] <= output[0]["lowrank_global_error"] + 1e-9
    rows = list(csv.DictReader((out / "analyze.csv").read_text().splitlines()))
    assert tuple(rows[0]) == CSV_FIELDS
    auto_output = [r for r in rows if r["family"] == "auto_output"]
    assert len(auto_output) == 2 and all(r["output_error"] and not r["error"] for r in auto_output)
    assert (out / "analyze.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_analyze_without_calibration_has_no_output_error(src, tmp_path):
    out = tmp_path / "an"
    assert cli(["analyze", str(src), "--rank", "0,4", "-o", str(out)]) == 0
    data = json.loads((out / "analyze.json").read_text())
    assert data["calibration"] is None and data["svd_output_curve"] == []
    assert all(p["output_error"] is None for p in data["points"])


def test_analyze_refuses_statistics_of_another_model(src, tmp_path, capsys):
    other = tmp_path / "other.safetensors"
    safetensors.numpy.save_file(
        {"model.layers.0.mlp.x_proj.input_gram": np.eye(3, dtype=np.float32)},
        str(other),
        metadata={"tokens": "3"},
    )
    out = tmp_path / "an"
    assert cli(["analyze", str(src), "--calibration", str(other), "-o", str(out)]) != 0
    err = capsys.readouterr().err.strip()
    assert "another model" in err and len(err.splitlines()) == 1
    assert not out.exists()
