"""``attnquant decompose --quant nvfp4``: a 4-bit ``W0`` with a low-rank correction (format v4)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from attnquant_cli import cli
from attnquant_core import ThetaCheckpoint, dequantize_nvfp4, open_checkpoint, quantize_nvfp4
from attnquant_core.testing import SHAPES16, make_weights, write_checkpoint


@pytest.fixture
def src(tmp_path):
    return write_checkpoint(tmp_path / "src", make_weights(3, shapes=SHAPES16))


def test_quant_decompose_is_passthrough_by_default_and_counts_bytes(src, tmp_path, capsys):
    out = tmp_path / "q"
    assert cli(["decompose", str(src), "-o", str(out), "--quant", "nvfp4", "--rank", "4"]) == 0
    table = " ".join(capsys.readouterr().out.split())
    assert "(G=3, r=4, W0 nvfp4)" in table
    assert "stored bytes" in table and "bytes / dense" in table
    ckpt = ThetaCheckpoint.open(out, blocks="layers")
    assert ckpt.format_version == 4 and ckpt.passthrough
    dense = open_checkpoint(src)
    info = dense.families["mlp.up_proj"]
    for layer, key in enumerate(info.keys):
        W = dense.get(key)
        # W0 is the layer's own weight in NVFP4, bit for bit the reference's
        assert np.array_equal(
            ckpt.shared("mlp.up_proj", layer), dequantize_nvfp4(quantize_nvfp4(W))
        )
    # 48x32 at 4.5 bits a weight plus the scale, and s, U, V in float32, per layer
    per_layer = 48 * 32 // 2 + 48 * 2 + 4 + (48 + 4 * (48 + 32)) * 4
    assert f"{3 * per_layer:,}" in table
    assert ckpt.families["mlp.up_proj"]["stored_bytes"] == 3 * per_layer


def test_quant_json_summary_has_the_bytes(src, tmp_path, capsys):
    out = tmp_path / "q"
    argv = ["decompose", str(src), "-o", str(out), "--quant", "nvfp4", "--rank", "0", "--json"]
    assert cli(argv) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["dense_bytes"] == 4 * got["dense_parameters"]
    assert got["stored_bytes"] == sum(f["stored_bytes"] for f in got["families"].values())
    assert all(f["quant"] == "nvfp4" for f in got["families"].values())
    # rank 0: 4.5 bits a weight, one float32 s per row and 4 bytes of global scale per layer
    want = sum(3 * (o * i // 2 + o * i // 16 + 4 + 4 * o) for o, i in SHAPES16.values())
    assert got["stored_bytes"] == want


def test_quant_with_blocks_and_calibration(src, tmp_path, capsys):
    from attnquant_core.calib import write_stats

    dense = open_checkpoint(src)
    rng = np.random.default_rng(0)
    grams = {}
    for info in dense.families.values():
        for key in info.keys:
            X = rng.standard_normal((info.shape[1], 64))
            grams[key] = X @ X.T
    stats = write_stats(tmp_path / "s.safetensors", grams, tokens=64)
    out = tmp_path / "q"
    argv = ["decompose", str(src), "-o", str(out), "--quant", "nvfp4", "--blocks", "1"]
    assert cli([*argv, "--rank", "2", "--calibration", str(stats)]) == 0
    assert "fit for the output error over 64 calibration tokens" in capsys.readouterr().err
    ckpt = ThetaCheckpoint.open(out)
    assert ckpt.blocks == 1 and ckpt.quant("mlp.up_proj") == "nvfp4"
    assert "calibration" in ckpt.manifest
    # the statistics cover every band: its codes are GPTQ's, and the manifest says so
    assert all(f["rounding"] == "gptq" for f in ckpt.manifest["families"].values())


def test_rounding_nearest_keeps_the_reference_nvfp4_with_statistics(src, tmp_path, capsys):
    from attnquant_core.calib import write_stats

    dense = open_checkpoint(src)
    rng = np.random.default_rng(1)
    grams = {}
    for info in dense.families.values():
        mix = rng.standard_normal((info.shape[1], info.shape[1]))
        for key in info.keys:
            X = mix @ rng.standard_normal((info.shape[1], 64))
            grams[key] = X @ X.T
    stats = write_stats(tmp_path / "s.safetensors", grams, tokens=64)
    argv = ["decompose", str(src), "--quant", "nvfp4", "--rank", "0", "--calibration", str(stats)]
    assert cli([*argv, "-o", str(tmp_path / "n"), "--rounding", "nearest"]) == 0
    assert cli([*argv, "-o", str(tmp_path / "g")]) == 0
    near, gptq = ThetaCheckpoint.open(tmp_path / "n"), ThetaCheckpoint.open(tmp_path / "g")
    assert not any("rounding" in f for f in near.manifest["families"].values())
    info = dense.families["mlp.down_proj"]
    for layer, key in enumerate(info.keys):
        ref = dequantize_nvfp4(quantize_nvfp4(dense.get(key)))
        assert np.array_equal(near.shared("mlp.down_proj", layer), ref)
        assert not np.array_equal(gptq.shared("mlp.down_proj", layer), ref)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--quant", "int4"], "--quant 'int4': choose one of nvfp4"),
        (["--quant", "nvfp4", "--calibration-data", "x.txt"], "--quant with --calibration-data"),
        (["--quant", "nvfp4", "--rounding", "up"], "--rounding 'up': choose one of gptq, nearest"),
    ],
)
def test_quant_refusals_are_one_line_and_write_nothing(src, tmp_path, capsys, extra, message):
    assert cli(["decompose", str(src), "-o", str(tmp_path / "t"), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "t").exists()


def test_inner_dimension_not_a_multiple_of_16_is_refused(tmp_path, capsys):
    src = write_checkpoint(tmp_path / "src", make_weights(2))  # hidden 24
    assert cli(["decompose", str(src), "-o", str(tmp_path / "t"), "--quant", "nvfp4"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "in=24" in err and "not a multiple of 16" in err
    assert not (tmp_path / "t").exists()
