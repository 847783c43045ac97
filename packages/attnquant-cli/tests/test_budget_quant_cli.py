"""``attnquant decompose --budget B --quant nvfp4``: a budget of bytes, a 4-bit W0 allowed."""

from __future__ import annotations

import json

import pytest

from attnquant_cli import cli
from attnquant_core import ThetaCheckpoint
from attnquant_core.testing import SHAPES16, make_weights, write_checkpoint


@pytest.fixture
def src(tmp_path):
    return write_checkpoint(tmp_path / "src", make_weights(3, shapes=SHAPES16))


def test_budget_with_quant_counts_bytes_in_the_table(src, tmp_path, capsys):
    out = tmp_path / "q"
    assert cli(["decompose", str(src), "-o", str(out), "--budget", "0.3", "--quant", "nvfp4"]) == 0
    table = " ".join(capsys.readouterr().out.split())
    assert "budget 0.3, auto form, bytes, W0 nvfp4 allowed" in table
    for word in ("stored bytes", "bytes / dense", "W0 nvfp4", "per-layer SVD", "why"):
        assert word in table
    assert "stored / dense" not in table  # parameters: a 4-bit weight would count as one
    ckpt = ThetaCheckpoint.open(out)
    manifest = ckpt.manifest
    summary = manifest["budget"]
    assert summary["currency"] == "bytes"
    assert summary["stored_bytes"] <= 0.3 * summary["dense_bytes"]
    assert summary["dense_bytes"] == 4 * summary["dense_parameters"]  # float32 weights
    assert f"{summary['stored_bytes']:,}" in table
    assert summary["stored_bytes"] == sum(f["stored_bytes"] for f in manifest["families"].values())
    assert any(f.get("quant") == "nvfp4" for f in manifest["families"].values())
    assert manifest["format_version"] == 4
    assert len(dict(ckpt.rebuilt_state())) == len(ckpt.stock_keys())


def test_budget_with_quant_json_has_the_bytes(src, tmp_path, capsys):
    out = tmp_path / "q"
    argv = ["decompose", str(src), "-o", str(out), "--budget", "0.5", "--quant", "nvfp4"]
    assert cli([*argv, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["dense_bytes"] == 4 * got["dense_parameters"]
    assert got["stored_bytes"] == sum(f["stored_bytes"] for f in got["families"].values())
    assert got["stored_bytes"] <= 0.5 * got["dense_bytes"]
    assert got["budget"]["stored_bytes"] == got["stored_bytes"]
    for fam in got["families"].values():
        assert fam["form"] in ("banded", "lowrank", "shared_basis")
        if fam.get("quant") is None:  # a float form: its numbers at float32
            assert fam["stored_bytes"] == 4 * fam["stored_parameters"]


def test_budget_without_quant_keeps_its_table(src, tmp_path, capsys):
    assert cli(["decompose", str(src), "-o", str(tmp_path / "t"), "--budget", "0.5"]) == 0
    table = " ".join(capsys.readouterr().out.split())
    assert "budget 0.5, auto form)" in table and "stored / dense" in table
    assert "stored bytes" not in table
    manifest = ThetaCheckpoint.open(tmp_path / "t").manifest
    assert "currency" not in manifest["budget"] and manifest["format_version"] == 2
    assert not any("stored_bytes" in f for f in manifest["families"].values())


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--quant", "int4"], "--quant 'int4': choose one of nvfp4"),
        (["--quant", "nvfp4", "--rank", "2"], "give either --budget or --blocks/--rank"),
        (["--quant", "nvfp4", "--calibration-data", "x.txt"], "--quant with --calibration-data"),
    ],
)
def test_budget_quant_refusals_are_one_line_and_write_nothing(
    src, tmp_path, capsys, extra, message
):
    argv = ["decompose", str(src), "-o", str(tmp_path / "t"), "--budget", "0.3", *extra]
    assert cli(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "t").exists()


def test_budget_quant_on_an_input_dim_not_a_multiple_of_16_is_refused(tmp_path, capsys):
    src = write_checkpoint(tmp_path / "src", make_weights(2))  # hidden 24
    argv = ["decompose", str(src), "-o", str(tmp_path / "t"), "--budget", "0.3", "--quant", "nvfp4"]
    assert cli(argv) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "in=24" in err and "not a multiple of 16" in err
    assert not (tmp_path / "t").exists()
