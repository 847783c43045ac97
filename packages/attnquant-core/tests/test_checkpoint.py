"""Reading Hugging Face checkpoints: layouts, dtypes, prefixes and every bad input of docs/architecture.md."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from attnquant_core import FAMILIES, CheckpointError, open_checkpoint, parse_projection_key
from attnquant_core.testing import SHAPES, make_weights, write_checkpoint


@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_reads_single_and_sharded_in_every_dtype(tmp_path, shards, dtype):
    tensors = make_weights(3, dtype=dtype)
    ckpt = open_checkpoint(write_checkpoint(tmp_path / "c", tensors, shards=shards))
    assert ckpt.num_layers == 3 and ckpt.stack == "model.layers"
    assert list(ckpt.families) == list(FAMILIES)
    assert ckpt.config == {"architectures": ["LlamaForCausalLM"]}
    for key, array in tensors.items():
        got = ckpt.get(key)
        assert got.dtype == np.dtype(dtype) and np.array_equal(got, array)
    info = ckpt.families["mlp.down_proj"]
    assert info.shape == SHAPES["mlp.down_proj"] and info.dtype == np.dtype(dtype)


def test_prefixed_keys_and_other_towers(tmp_path):
    tensors = make_weights(2, prefix="model.language_model")
    tensors["model.vision_tower.encoder.layers.0.self_attn.q_proj.weight"] = np.ones((4, 4), "f4")
    ckpt = open_checkpoint(write_checkpoint(tmp_path / "c", tensors))
    assert ckpt.stack == "model.language_model.layers" and ckpt.num_layers == 2


def test_parse_projection_key():
    assert parse_projection_key("model.layers.12.mlp.up_proj.weight") == (
        "model.layers",
        12,
        "mlp.up_proj",
    )
    assert parse_projection_key("model.layers.1.input_layernorm.weight") is None


def test_single_file_path(tmp_path):
    path = write_checkpoint(tmp_path / "c", make_weights(2)) / "model.safetensors"
    assert open_checkpoint(path).num_layers == 2


def test_missing_checkpoint_and_files(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        open_checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        open_checkpoint(tmp_path / "empty")
    ckpt = write_checkpoint(tmp_path / "c", make_weights(2), shards=2)
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(
        CheckpointError, match="model-00002-of-00002.safetensors: safetensors file is missing"
    ):
        open_checkpoint(ckpt)


def test_truncated_file(tmp_path):
    ckpt = write_checkpoint(tmp_path / "c", make_weights(2))
    f = ckpt / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(
        CheckpointError, match=r"model\.safetensors: not a readable safetensors file"
    ):
        open_checkpoint(ckpt)


def test_shape_mismatch_inside_a_family(tmp_path):
    tensors = make_weights(3)
    tensors["model.layers.1.mlp.up_proj.weight"] = np.ones((7, 24), np.float32)
    with pytest.raises(
        CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight is \[7, 24\]"
    ):
        open_checkpoint(write_checkpoint(tmp_path / "c", tensors))


def test_missing_layer_of_a_family(tmp_path):
    tensors = make_weights(3)
    del tensors["model.layers.1.self_attn.v_proj.weight"]
    with pytest.raises(
        CheckpointError, match=r"model\.layers\.1\.self_attn\.v_proj\.weight is missing"
    ):
        open_checkpoint(write_checkpoint(tmp_path / "c", tensors))


def test_unknown_architecture(tmp_path):
    d = tmp_path / "c"
    d.mkdir()
    safetensors.numpy.save_file(
        {"transformer.h.0.attn.c_attn.weight": np.ones((4, 4), "f4")}, d / "model.safetensors"
    )
    with pytest.raises(CheckpointError, match="unknown architecture"):
        open_checkpoint(d)


def test_nan_weights_are_named(tmp_path):
    tensors = make_weights(2)
    tensors["model.layers.1.self_attn.o_proj.weight"][0, 0] = np.inf
    ckpt = open_checkpoint(write_checkpoint(tmp_path / "c", tensors))
    with pytest.raises(
        CheckpointError, match=r"layers\.1\.self_attn\.o_proj\.weight holds 1 NaN/Inf"
    ):
        ckpt.get("model.layers.1.self_attn.o_proj.weight", check_finite=True)


def test_bad_index_and_config(tmp_path):
    ckpt = write_checkpoint(tmp_path / "c", make_weights(2), shards=2)
    (ckpt / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no valid weight_map"):
        open_checkpoint(ckpt)
    (ckpt / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"ghost.weight": "model-00001-of-00002.safetensors"}})
    )
    with pytest.raises(CheckpointError, match="'ghost.weight' is listed in the index"):
        open_checkpoint(ckpt)
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON"):
        open_checkpoint(ckpt)
