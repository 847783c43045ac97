"""Bad input to `attnquant serve` fails at start-up, before MAX builds anything (docs/architecture.md)."""

from __future__ import annotations

import json
import shutil

import pytest
import safetensors.numpy

from attnquant_cli import cli


@pytest.mark.parametrize(
    ("variable", "value"),
    [("ATTNQUANT_RANK", "-1"), ("ATTNQUANT_BLOCKS", "0"), ("ATTNQUANT_GEMM", "maybe")],
)
def test_bad_variable_names_itself(demo, monkeypatch, capsys, variable, value):
    monkeypatch.setenv(variable, value)
    assert cli(["serve", str(demo)]) == 2
    err = capsys.readouterr().err
    assert variable in err
    assert repr(value) in err or value in err


def test_missing_theta_v_lists_the_layer(theta_dir, tmp_path, capsys):
    theta = tmp_path / "theta"
    shutil.copytree(theta_dir(3, 4), theta)
    f = theta / "model.safetensors"
    tensors = safetensors.numpy.load_file(f)
    del tensors["model.layers.4.mlp.up_proj.theta_V"]
    safetensors.numpy.save_file(tensors, f)
    assert cli(["serve", str(theta)]) == 2
    err = capsys.readouterr().err
    assert "mlp.up_proj layer 4" in err
    assert "ATTNQUANT_BLOCKS" in err


def test_other_blocks_in_manifest_lists_the_layers(theta_dir, tmp_path, capsys):
    theta = tmp_path / "theta"
    shutil.copytree(theta_dir(3, 4), theta)
    manifest = json.loads((theta / "attnquant.json").read_text())
    manifest["blocks"] = 2
    (theta / "attnquant.json").write_text(json.dumps(manifest))
    assert cli(["serve", str(theta)]) == 2
    err = capsys.readouterr().err
    assert "layers [2]" in err or "layers [" in err
    assert "ATTNQUANT_BLOCKS" in err


def test_serving_with_other_blocks_is_refused(theta_dir, monkeypatch, capsys):
    monkeypatch.setenv("ATTNQUANT_BLOCKS", "6")
    assert cli(["serve", str(theta_dir(3, 4))]) == 2
    err = capsys.readouterr().err
    assert "decomposed with blocks=3, asked to serve blocks=6" in err
