"""The theta checkpoint: streamed writes, bit-exact round trips, validation, atomicity."""

from __future__ import annotations

import json
import os
import shutil

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

import attnquant_core as aq
from attnquant_core import (
    BandMismatchError,
    CheckpointError,
    DecompositionError,
    ThetaCheckpoint,
    ThetaFormatError,
    decompose_checkpoint,
    open_checkpoint,
)
from attnquant_core.io import PlannedWriter, TensorSpec
from attnquant_core.testing import make_weights, write_checkpoint


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("blocks", [1, 2, "layers"])
def test_streamed_decomposition_equals_in_memory(checkpoint, tmp_path, dtype, blocks):
    src = checkpoint(5, dtype=dtype)
    manifest = decompose_checkpoint(src, tmp_path / "theta", blocks=blocks, rank=3)
    theta = ThetaCheckpoint.open(tmp_path / "theta")
    ckpt = open_checkpoint(src)
    assert theta.blocks == manifest["blocks"] == aq.resolve_blocks(blocks, 5)
    for name, info in ckpt.families.items():
        weights = [ckpt.get(k) for k in info.keys]
        ref, errs = aq.decompose_family(weights, blocks=blocks, rank=3, name=name)
        got = theta.family(name)
        for a, b in zip(ref.shared, got.shared, strict=True):
            assert a.dtype == b.dtype == np.dtype(dtype) and np.array_equal(a, b)
        for a, b in zip(ref.layers, got.layers, strict=True):
            assert all(np.array_equal(getattr(a, p), getattr(b, p)) for p in "sUV")
        assert manifest["families"][name]["errors"] == errs.errors


def test_passthrough_rebuilds_every_weight_exactly(checkpoint, tmp_path):
    src = checkpoint(4, dtype=ml_dtypes.bfloat16)
    decompose_checkpoint(src, tmp_path / "theta", blocks="layers", rank=2)
    theta = ThetaCheckpoint.open(tmp_path / "theta")
    assert theta.passthrough
    ckpt = open_checkpoint(src)
    state = dict(theta.rebuilt_state())
    assert sorted(state) == ckpt.keys() == theta.stock_keys()
    for key, array in state.items():
        assert array.dtype == ml_dtypes.bfloat16 and np.array_equal(array, ckpt.get(key)), key
    assert state.keys() == dict(aq.rebuild_dense_state(src, blocks="layers", rank=2)).keys()


def test_manifest_records_bands_errors_digests_and_side_files(checkpoint, tmp_path):
    src = checkpoint(5)
    decompose_checkpoint(src, tmp_path / "theta", blocks=2, rank=4)
    manifest = json.loads((tmp_path / "theta" / "attnquant.json").read_text())
    assert manifest["format_version"] == 2 and manifest["blocks"] == 2
    fam = manifest["families"]["mlp.up_proj"]
    assert fam["bands"] == [0, 0, 0, 1, 1] and len(fam["errors"]) == 5 and fam["rank"] == 4
    assert 0 < fam["error"] < 1
    digests = manifest["source"]["digests"]
    assert len(digests) == len(open_checkpoint(src).keys())
    assert all(d.startswith("sha256:") for d in digests.values())
    assert (tmp_path / "theta" / "tokenizer.json").exists()
    assert (tmp_path / "theta" / "config.json").read_text() == (src / "config.json").read_text()


def test_save_and_load_round_trip_is_bit_exact(checkpoint, tmp_path):
    ckpt = open_checkpoint(checkpoint(4, dtype=ml_dtypes.bfloat16))
    families = {}
    for name, info in ckpt.families.items():
        families[name], _ = aq.decompose_family(
            [ckpt.get(k) for k in info.keys], blocks=2, rank=2, name=name
        )
    extra = {k: ckpt.get(k) for k in ckpt.keys() if k not in ckpt.projection_keys()}
    model = aq.ThetaModel(families=families, extra=extra)
    aq.save_theta(model, tmp_path / "theta", config={"x": 1})
    back = ThetaCheckpoint.open(tmp_path / "theta").load()
    for name, fam in model.families.items():
        got = back.families[name]
        assert got.bands == fam.bands
        for a, b in zip(fam.shared, got.shared, strict=True):
            assert a.dtype == b.dtype and np.array_equal(a, b)
        for a, b in zip(fam.layers, got.layers, strict=True):
            assert all(np.array_equal(getattr(a, p), getattr(b, p)) for p in "sUV")
    assert all(np.array_equal(extra[k], back.extra[k]) for k in extra)


def test_transposed_array_round_trip_is_exact(tmp_path):
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    writer = PlannedWriter(tmp_path, {"t": TensorSpec(np.dtype(np.float32), (6, 4))})
    writer.write("t", a.T)  # a non-contiguous view
    writer.close()
    back = safetensors.numpy.load_file(tmp_path / "model.safetensors")["t"]
    assert np.array_equal(back, a.T)


def test_planned_writer_shards_and_index(tmp_path):
    specs = {f"t{i}": TensorSpec(np.dtype(np.float32), (10, 10)) for i in range(5)}
    writer = PlannedWriter(tmp_path, specs, max_shard_bytes=900)
    for i in range(5):
        writer.write(f"t{i}", np.full((10, 10), i, np.float32))
    writer.close()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3
    for key, name in index["weight_map"].items():
        assert np.all(safetensors.numpy.load_file(tmp_path / name)[key] == int(key[1:]))


def test_planned_writer_refuses_wrong_or_missing_tensors(tmp_path):
    writer = PlannedWriter(
        tmp_path,
        {"a": TensorSpec(np.dtype(np.float32), (2,)), "b": TensorSpec(np.dtype(np.float32), (2,))},
    )
    with pytest.raises(ValueError, match="planned float32"):
        writer.write("a", np.ones(3, np.float32))
    writer.write("a", np.ones(2, np.float32))
    with pytest.raises(RuntimeError, match="never written"):
        writer.close()


def test_sharded_output(checkpoint, tmp_path):
    decompose_checkpoint(checkpoint(3), tmp_path / "theta", blocks=1, rank=2, max_shard_bytes=4096)
    assert (tmp_path / "theta" / "model.safetensors.index.json").exists()
    theta = ThetaCheckpoint.open(tmp_path / "theta")
    assert len(list((tmp_path / "theta").glob("*.safetensors"))) > 2
    assert len(dict(theta.rebuilt_state())) == len(theta.stock_keys())


# -- bad input -------------------------------------------------------------------------------


@pytest.fixture
def theta_dir(checkpoint, tmp_path):
    decompose_checkpoint(checkpoint(4), tmp_path / "theta", blocks=2, rank=2)
    return tmp_path / "theta"


def _drop_key(directory, key):
    f = directory / "model.safetensors"
    tensors = safetensors.numpy.load_file(f)
    del tensors[key]
    safetensors.numpy.save_file(tensors, f)


def test_missing_theta_v_lists_the_layer(theta_dir):
    _drop_key(theta_dir, "model.layers.2.self_attn.k_proj.theta_V")
    with pytest.raises(
        BandMismatchError, match=r"self_attn\.k_proj layer 2: .*theta_V \(missing"
    ) as e:
        ThetaCheckpoint.open(theta_dir)
    assert "ATTNQUANT_BLOCKS" in str(e.value)


def test_theta_keys_without_their_w0(theta_dir):
    _drop_key(theta_dir, "attnquant.shared.mlp.gate_proj.1.W0")
    with pytest.raises(
        BandMismatchError, match=r"mlp\.gate_proj layer 2: .*W0 \(missing.*mlp\.gate_proj layer 3"
    ):
        ThetaCheckpoint.open(theta_dir)


def test_blocks_edited_in_manifest_lists_layers(theta_dir):
    path = theta_dir / "attnquant.json"
    manifest = json.loads(path.read_text())
    manifest["blocks"] = 4
    path.write_text(json.dumps(manifest))
    with pytest.raises(BandMismatchError, match=r"layers \[1, 2, 3\]"):
        ThetaCheckpoint.open(theta_dir)


def test_serving_with_other_blocks_lists_layers(theta_dir):
    with pytest.raises(
        BandMismatchError,
        match=r"decomposed with blocks=2, asked to serve blocks=4: layers \[1, 2, 3\]",
    ):
        ThetaCheckpoint.open(theta_dir, blocks=4)
    assert ThetaCheckpoint.open(theta_dir, blocks=2).blocks == 2


def test_newer_format_version_is_refused(theta_dir):
    path = theta_dir / "attnquant.json"
    manifest = json.loads(path.read_text())
    manifest["format_version"] = aq.FORMAT_VERSION + 1
    path.write_text(json.dumps(manifest))
    with pytest.raises(ThetaFormatError, match="newer attnquant.*upgrade attnquant-core"):
        ThetaCheckpoint.open(theta_dir)


def test_not_a_theta_checkpoint(checkpoint):
    with pytest.raises(ThetaFormatError, match="no attnquant.json"):
        ThetaCheckpoint.open(checkpoint(2))


def test_interrupted_write_leaves_nothing(checkpoint, tmp_path, monkeypatch):
    src = checkpoint(3)
    calls = iter(range(100))

    def fail_midway(event):
        if next(calls) == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        decompose_checkpoint(src, tmp_path / "theta", blocks=1, rank=2, progress=fail_midway)
    assert os.listdir(tmp_path) == [src.name]


def test_nan_weight_leaves_nothing(tmp_path):
    tensors = make_weights(3)
    tensors["model.layers.2.mlp.down_proj.weight"][1, 1] = np.nan
    src = write_checkpoint(tmp_path / "src", tensors)
    with pytest.raises(
        CheckpointError, match=r"model\.layers\.2\.mlp\.down_proj\.weight holds 1 NaN"
    ):
        decompose_checkpoint(src, tmp_path / "theta", rank=2)
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_rank_and_blocks_are_checked_before_writing(checkpoint, tmp_path):
    src = checkpoint(3)
    with pytest.raises(
        DecompositionError, match=r"self_attn\.k_proj: rank=9 exceeds min\(out, in\)=8"
    ):
        decompose_checkpoint(src, tmp_path / "theta", rank=9)
    with pytest.raises(DecompositionError, match="blocks=4 is outside"):
        decompose_checkpoint(src, tmp_path / "theta", blocks=4)
    assert not (tmp_path / "theta").exists()


def test_existing_output_is_not_overwritten(theta_dir, checkpoint):
    before = (theta_dir / "attnquant.json").read_text()
    with pytest.raises(FileExistsError):
        decompose_checkpoint(checkpoint(2), theta_dir, rank=2)
    assert (theta_dir / "attnquant.json").read_text() == before
    decompose_checkpoint(checkpoint(2), theta_dir, rank=2, overwrite=True)
    assert ThetaCheckpoint.open(theta_dir).num_layers == 2
    shutil.rmtree(theta_dir)
