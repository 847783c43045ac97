"""Reliability: hostile or inconsistent checkpoints refused, every written byte checked, faults
during a write leave nothing behind, and a served model leaves no process behind.

Each test reproduces one fault of issue 16; each failed on the code before the fix.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from attnquant_cli import cli
from attnquant_core.testing import make_weights, write_checkpoint


def _one_line_error(capsys, *needles: str) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: "), err
    assert len(err.splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err
    return err


def _copy_demo(demo: Path, to: Path) -> Path:
    shutil.copytree(demo, to)
    return to


# -- hostile or inconsistent checkpoints ------------------------------------------------------


def test_index_shard_outside_the_directory_is_refused(demo, tmp_path, capsys):
    ckpt = _copy_demo(demo, tmp_path / "ckpt")
    (ckpt / "model.safetensors").rename(tmp_path / "elsewhere.safetensors")
    header = json.loads(_raw_header(tmp_path / "elsewhere.safetensors"))
    weight_map = {k: "../elsewhere.safetensors" for k in header if k != "__metadata__"}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    out = tmp_path / "theta"
    assert cli(["decompose", str(ckpt), "-o", str(out), "--rank", "2"]) == 2
    _one_line_error(capsys, "model.safetensors.index.json", "../elsewhere.safetensors", "outside")
    assert not out.exists()


def test_index_shard_through_a_link_outside_the_directory_is_refused(demo, tmp_path, capsys):
    ckpt = _copy_demo(demo, tmp_path / "ckpt")
    (tmp_path / "outside").mkdir()
    (ckpt / "model.safetensors").rename(tmp_path / "outside" / "model.safetensors")
    (ckpt / "shards").symlink_to(tmp_path / "outside", target_is_directory=True)
    header = json.loads(_raw_header(tmp_path / "outside" / "model.safetensors"))
    weight_map = {k: "shards/model.safetensors" for k in header if k != "__metadata__"}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    out = tmp_path / "theta"
    assert cli(["decompose", str(ckpt), "-o", str(out), "--rank", "2"]) == 2
    _one_line_error(capsys, "shards/model.safetensors", "outside the checkpoint directory")
    assert not out.exists()


@pytest.mark.parametrize(
    ("field", "value", "names"),
    [
        ("hidden_size", 10**9, "q_proj"),
        ("num_hidden_layers", 10**6, "6 decoder layers"),
        ("intermediate_size", 1024, "gate_proj"),
        ("num_attention_heads", 12, "q_proj"),
        ("num_key_value_heads", 3, "k_proj"),
        ("head_dim", 16, "q_proj"),
        ("vocab_size", 4096, "embed_tokens"),
        ("hidden_size", "192", "not a positive integer"),
    ],
)
def test_config_that_disagrees_with_the_tensors_is_refused(
    demo, tmp_path, capsys, field, value, names
):
    ckpt = _copy_demo(demo, tmp_path / "ckpt")
    config = json.loads((ckpt / "config.json").read_text())
    config[field] = value
    (ckpt / "config.json").write_text(json.dumps(config))
    out = tmp_path / "theta"
    assert cli(["decompose", str(ckpt), "-o", str(out), "--rank", "2"]) == 2
    _one_line_error(capsys, "config.json", field, names)
    assert not out.exists()


def test_theta_checkpoint_with_a_config_that_disagrees_is_refused(demo, tmp_path, capsys):
    from attnquant_core import ThetaCheckpoint

    out = tmp_path / "theta"
    assert cli(["decompose", str(demo), "-o", str(out), "--blocks", "layers", "--rank", "0"]) == 0
    config = json.loads((out / "config.json").read_text())
    config["num_hidden_layers"] = 10**6
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="num_hidden_layers is 1000000 but the tensors hold 6"):
        ThetaCheckpoint.open(out)


def _raw_header(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(int.from_bytes(f.read(8), "little"))


def _write_raw(path: Path, header: dict, data: bytes) -> Path:
    blob = json.dumps(header).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    return path


@pytest.mark.parametrize(
    ("offsets", "shape", "data_len"),
    [
        ([0, 64], [4, 4], 32),  # past the end of the file
        ([0, 64], [4, 4], 128),  # the next tensor starts inside this one
        ([0, 64], [4, 8], 64),  # 64 bytes cannot hold a float32 [4, 8]
    ],
    ids=["exceeds-file", "overlap", "shape-mismatch"],
)
def test_header_offsets_that_do_not_fit_are_refused(tmp_path, capsys, offsets, shape, data_len):
    """Already refused before issue 16 (by safetensors' own validation); kept with this test."""
    src = write_checkpoint(tmp_path / "src", make_weights(2))
    header = {"lm_head.weight": {"dtype": "F32", "shape": shape, "data_offsets": offsets}}
    if data_len == 128:  # overlap: a second tensor whose range starts inside the first
        header["other"] = {"dtype": "F32", "shape": [4, 4], "data_offsets": [32, 96]}
    _write_raw(src / "zz-extra.safetensors", header, bytes(data_len))
    out = tmp_path / "theta"
    assert cli(["decompose", str(src), "-o", str(out), "--rank", "2"]) == 2
    _one_line_error(capsys, "zz-extra.safetensors")
    assert not out.exists()
