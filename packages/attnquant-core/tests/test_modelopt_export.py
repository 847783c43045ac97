"""``export_nvfp4``: a modelopt NVFP4 checkpoint from a dense or theta checkpoint (numpy only).

That MAX reads the result as NVFP4 is checked in attnquant-max (``test_export.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

from attnquant_core import FAMILIES, ThetaCheckpoint, decompose_checkpoint
from attnquant_core.forms import (
    NVFP4Error,
    NVFP4Tensor,
    dequantize_nvfp4,
    nvfp4_error_bound,
    quantize_nvfp4,
)
from attnquant_core.io import (
    HF_QUANT_CONFIG_FILE,
    ExportProgress,
    SafetensorsFiles,
    export_nvfp4,
)
from attnquant_core.testing import (
    EXPORT_LAYERS,
    EXPORT_SHAPES,
    export_source_tensors,
    make_weights,
    write_checkpoint,
)

LAYERS, SHAPES = EXPORT_LAYERS, EXPORT_SHAPES
PARTS = {  # suffix -> (safetensors dtype, shape from the dense (out, in))
    "weight": ("U8", lambda o, i: (o, i // 2)),
    "weight_scale": ("F8_E4M3", lambda o, i: (o, i // 16)),
    "weight_scale_2": ("F32", lambda o, i: ()),
    "input_scale": ("F32", lambda o, i: ()),
}


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("src") / "dense", export_source_tensors())


@pytest.fixture(scope="module")
def exported(dense: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("out") / "nvfp4"
    events: list[ExportProgress] = []
    summary = export_nvfp4(dense, out, progress=events.append)
    summary["_events"] = events
    return out, summary


def header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Dtype and shape of every tensor, as the ``safetensors`` library reads the file."""
    found = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="numpy") as f:
            for key in f.keys():
                part = f.get_slice(key)
                found[key] = (part.get_dtype(), tuple(part.get_shape()))
    return found


def read_nvfp4(files: SafetensorsFiles, prefix: str) -> NVFP4Tensor:
    # safetensors' numpy backend has no float8, so the scales come through attnquant-core's reader.
    return NVFP4Tensor(
        weight=files.get(f"{prefix}.weight"),
        weight_scale=files.get(f"{prefix}.weight_scale"),
        weight_scale_2=files.get(f"{prefix}.weight_scale_2"),
    )


def test_keys_dtypes_and_shapes_follow_the_modelopt_layout(dense: Path, exported):
    out, _ = exported
    found = header(out)
    src = export_source_tensors()
    expected: dict[str, tuple[str, tuple[int, ...]]] = {}
    for key, array in src.items():
        family = next((f for f in FAMILIES if key.endswith(f"{f}.weight")), None)
        if family is None:
            expected[key] = ("F32", array.shape)
            continue
        prefix = key.removesuffix(".weight")
        for suffix, (dtype, shape) in PARTS.items():
            expected[f"{prefix}.{suffix}"] = (dtype, shape(*array.shape))
    assert found == expected


def test_file_reads_back_with_safetensors(dense: Path, exported):
    out, _ = exported
    src = export_source_tensors()
    with safe_open(str(out / "model.safetensors"), framework="numpy") as f:
        assert f.metadata() == {"format": "pt"}
        # Every tensor safetensors' numpy backend can hold (all but the float8 scales).
        for key in f.keys():
            if key.endswith(".weight_scale"):
                continue
            array = f.get_tensor(key)
            if key in src and not key.endswith("_proj.weight"):
                np.testing.assert_array_equal(array, src[key])  # copied unchanged
            if key.endswith(("input_scale", "weight_scale_2")):
                assert array.shape == () and array.dtype == np.float32
            if key.endswith("input_scale"):
                assert array == 1.0


def test_quantized_weights_are_the_reference_quantizer_output(exported):
    out, summary = exported
    src = export_source_tensors()
    files = SafetensorsFiles.from_files(sorted(out.glob("*.safetensors")))
    for key, W in src.items():
        if not key.endswith("_proj.weight"):
            continue
        got = read_nvfp4(files, key.removesuffix(".weight"))
        want = quantize_nvfp4(W)
        np.testing.assert_array_equal(got.weight, want.weight)
        np.testing.assert_array_equal(
            got.weight_scale.view(np.uint8), want.weight_scale.view(np.uint8)
        )
        assert got.weight_scale_2 == want.weight_scale_2
        err = np.abs(W - dequantize_nvfp4(got))
        assert (err <= nvfp4_error_bound(W, got)).all()
        assert summary["tensors"][key]["max_abs_error"] == pytest.approx(float(err.max()))


def test_configs_are_modelopt_nvfp4(dense: Path, exported):
    out, _ = exported
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]  # the source config, kept
    qc = config["quantization_config"]
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == "NVFP4"
    assert qc["ignore"] == ["lm_head"]
    group = qc["config_groups"]["group_0"]
    for side in ("weights", "input_activations"):
        assert group[side] == {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
    hf = json.loads((out / HF_QUANT_CONFIG_FILE).read_text())
    assert hf["producer"]["name"] == "modelopt"
    assert hf["quantization"] == {
        "quant_algo": "NVFP4",
        "kv_cache_quant_algo": None,
        "group_size": 16,
        "exclude_modules": ["lm_head"],
    }
    assert (out / "tokenizer.json").read_text() == (dense / "tokenizer.json").read_text()
    assert not list(out.parent.glob(".nvfp4.tmp-*"))


def test_summary_counts_bytes(exported):
    _, summary = exported
    n = LAYERS * len(SHAPES)
    assert summary["quantized"] == n and summary["copied"] == 3  # embed, norm, lm_head
    dense_elems = LAYERS * sum(o * i for o, i in SHAPES.values())
    assert summary["float32_bytes"] == summary["source_bytes"] == 4 * dense_elems
    scales = LAYERS * sum(o * i // 16 for o, i in SHAPES.values())
    assert summary["packed_bytes"] == dense_elems // 2 + scales + n * 8
    assert 0 < summary["max_rel_error"] < 0.2
    assert summary["source_kind"] == "dense"
    events = summary["_events"]
    assert [e.done for e in events] == list(range(1, n + 4))
    assert sum(e.quantized for e in events) == n


def test_theta_source_exports_the_rebuilt_weights(dense: Path, tmp_path: Path):
    theta_dir = tmp_path / "theta_g1"  # one shared block per family, rank 8
    decompose_checkpoint(dense, theta_dir, blocks=1, rank=8)
    out = tmp_path / "theta_nvfp4"
    summary = export_nvfp4(theta_dir, out)
    assert summary["source_kind"] == "theta"
    theta = ThetaCheckpoint.open(theta_dir)
    assert summary["quantized"] == theta.num_layers * len(theta.families)
    files = SafetensorsFiles.from_files(sorted(out.glob("*.safetensors")))
    assert not any(".theta_" in k or k.startswith("attnquant.") for k in files.keys())
    assert not (out / "attnquant.json").exists()
    for name in theta.families:
        for layer in range(theta.num_layers):
            W = theta.rebuild(name, layer)
            got = read_nvfp4(files, f"{theta.stack}.{layer}.{name}")
            want = quantize_nvfp4(W)
            np.testing.assert_array_equal(got.weight, want.weight)
            assert got.weight_scale_2 == want.weight_scale_2
    for key in theta.copied_keys():
        np.testing.assert_array_equal(files.get(key), theta.tensors.get(key))


def test_bfloat16_tensors_stay_bfloat16(tmp_path: Path):
    src = write_checkpoint(tmp_path / "bf16", export_source_tensors(ml_dtypes.bfloat16))
    summary = export_nvfp4(src, tmp_path / "out")
    assert summary["source_dtypes"] == ["BF16"]
    assert summary["source_bytes"] * 2 == summary["float32_bytes"]
    files = SafetensorsFiles.from_files([tmp_path / "out" / "model.safetensors"])
    assert files.spec("model.embed_tokens.weight").dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(
        files.get("lm_head.weight"), export_source_tensors(ml_dtypes.bfloat16)["lm_head.weight"]
    )
    assert header(tmp_path / "out")["model.layers.0.mlp.up_proj.weight"] == ("U8", (48, 16))


def test_input_scale_option(dense: Path, tmp_path: Path):
    export_nvfp4(dense, tmp_path / "out", input_scale=0.05)
    files = SafetensorsFiles.from_files([tmp_path / "out" / "model.safetensors"])
    assert files.get("model.layers.2.self_attn.o_proj.input_scale") == np.float32(0.05)
    with pytest.raises(NVFP4Error, match="input_scale"):
        export_nvfp4(dense, tmp_path / "bad", input_scale=0.0)


def test_inner_dimension_not_multiple_of_16_is_refused_before_writing(tmp_path: Path):
    src = write_checkpoint(tmp_path / "odd", make_weights(2))  # inner dimensions 24, 32, 40
    out = tmp_path / "out"
    # Keys are planned in sorted order: down_proj (40 inputs) is the first refused.
    with pytest.raises(NVFP4Error, match=r"model\.layers\.0\.mlp\.down_proj\.weight: inner") as e:
        export_nvfp4(src, out)
    assert str(src) in str(e.value) and "multiple of 16" in str(e.value)
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_non_finite_weight_leaves_nothing(tmp_path: Path):
    tensors = export_source_tensors()
    tensors["model.layers.1.mlp.down_proj.weight"][3, 4] = np.nan
    src = write_checkpoint(tmp_path / "nan", tensors)
    out = tmp_path / "out"
    with pytest.raises(NVFP4Error, match=r"model\.layers\.1\.mlp\.down_proj\.weight: holds 1 NaN"):
        export_nvfp4(src, out)
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_existing_output_needs_overwrite(dense: Path, tmp_path: Path):
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(FileExistsError, match="overwrite"):
        export_nvfp4(dense, out)
    export_nvfp4(dense, out, overwrite=True)
    assert (out / "hf_quant_config.json").is_file()
    with pytest.raises(ValueError, match="its own source"):
        export_nvfp4(dense, dense, overwrite=True)
