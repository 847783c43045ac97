"""`attnquant export --format nvfp4` on the demo model: Model Optimizer's layout, key by key."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np

from attnquant_cli import cli
from attnquant_core import open_checkpoint
from attnquant_core.io import SafetensorsFiles


def test_export_demo_theta_to_nvfp4(demo, theta_dir, tmp_path, capsys):
    out = tmp_path / "fp4"
    argv = ["export", str(theta_dir("layers", 0)), "-o", str(out), "--format", "nvfp4"]
    assert cli(argv) == 0
    assert "projections in NVFP4" in capsys.readouterr().out  # one line, never wrapped
    assert cli([*argv, "--overwrite", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["format"], summary["quantized"], summary["copied"]) == ("nvfp4", 42, 15)
    # safetensors.numpy cannot build float8 arrays; core's reader maps them through ml_dtypes.
    files = SafetensorsFiles.from_files(sorted(out.glob("*.safetensors")))
    tensors = {key: files.get(key) for key in files.keys()}
    dense = open_checkpoint(demo)
    for info in dense.families.values():
        out_dim, in_dim = info.shape
        for key in info.keys:
            prefix = key.removesuffix(".weight")
            assert tensors[f"{prefix}.weight"].dtype == np.uint8
            assert tensors[f"{prefix}.weight"].shape == (out_dim, in_dim // 2)
            assert tensors[f"{prefix}.weight_scale"].dtype == ml_dtypes.float8_e4m3fn
            assert tensors[f"{prefix}.weight_scale"].shape == (out_dim, in_dim // 16)
            assert tensors[f"{prefix}.weight_scale_2"].dtype == np.float32
            assert tensors[f"{prefix}.weight_scale_2"].shape == ()
            assert tensors[f"{prefix}.input_scale"].shape == ()
    for key in dense.keys():
        if key not in dense.projection_keys():
            assert np.array_equal(tensors[key], dense.get(key)), key
    quant = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert quant["quant_algo"] == "NVFP4"
    assert quant["group_size"] == 16
    assert (
        json.loads((out / "config.json").read_text())["quantization_config"]["quant_algo"]
        == "NVFP4"
    )


def test_export_refuses_other_formats(demo, tmp_path, capsys):
    assert cli(["export", str(demo), "-o", str(tmp_path / "x"), "--format", "int4"]) == 2
    assert "only 'nvfp4'" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
