"""`attnquant decompose` end to end: the CLI writes a theta checkpoint that core reads back."""

from __future__ import annotations

import json

import numpy as np
import pytest

from attnquant_cli import cli
from attnquant_core import ThetaCheckpoint, open_checkpoint
from attnquant_core.testing import make_weights, write_checkpoint


@pytest.fixture
def src(tmp_path):
    return write_checkpoint(tmp_path / "src", make_weights(4))


@pytest.mark.parametrize(("blocks", "G"), [("1", 1), ("2", 2), ("layers", 4)])
def test_decompose_round_trip(src, tmp_path, capsys, blocks, G):
    out = tmp_path / "theta"
    assert cli(["decompose", str(src), "-o", str(out), "--blocks", blocks, "--rank", "4"]) == 0
    theta = ThetaCheckpoint.open(out)
    assert (theta.blocks, theta.rank) == (G, 4)
    table = capsys.readouterr().out
    assert "mlp.down_proj" in table
    assert "total" in table
    dense = open_checkpoint(src)
    if blocks == "layers":
        for key, array in theta.rebuilt_state():
            assert np.array_equal(array, dense.get(key)), key


def test_bad_blocks_fails_with_one_line_and_writes_nothing(src, tmp_path, capsys):
    out = tmp_path / "theta"
    assert cli(["decompose", str(src), "-o", str(out), "--blocks", "5", "--rank", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: blocks=5 is outside 1..4")
    assert len(err.splitlines()) == 1
    assert not out.exists()
    assert cli(["decompose", str(src), "-o", str(out), "--blocks", "two"]) == 2
    assert "blocks='two' is not an integer or 'layers'" in capsys.readouterr().err


def test_rank_too_large_names_the_family(src, tmp_path, capsys):
    assert cli(["decompose", str(src), "-o", str(tmp_path / "t"), "--rank", "9"]) == 2
    assert "self_attn.k_proj: rank=9 exceeds min(out, in)=8" in capsys.readouterr().err


def test_missing_checkpoint_and_existing_output(src, tmp_path, capsys):
    assert cli(["decompose", str(tmp_path / "nope"), "-o", str(tmp_path / "t")]) == 2
    assert "no such checkpoint" in capsys.readouterr().err
    out = tmp_path / "theta"
    assert cli(["decompose", str(src), "-o", str(out), "--rank", "2"]) == 0
    manifest = (out / "attnquant.json").read_text()
    assert cli(["decompose", str(src), "-o", str(out), "--rank", "3"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert (out / "attnquant.json").read_text() == manifest
    assert cli(["decompose", str(src), "-o", str(out), "--rank", "3", "--overwrite"]) == 0
    assert json.loads((out / "attnquant.json").read_text())["rank"] == 3


@pytest.mark.parametrize("args", [["--blocks", "layers", "--rank", "0"], ["--budget", "0.5"]])
def test_decompose_align_keeps_the_function(demo, tmp_path, capsys, args):
    """`decompose --align`: the transforms are recorded and, at passthrough, the rebuilt model is
    the demo's function to float32 round-off (numpy reference forward)."""
    from attnquant_core import ALIGN_MANIFEST_FILE, load_align_transforms, unalign_state
    from attnquant_core.llama_reference import llama_logits

    out = tmp_path / "aligned-theta"
    assert cli(["decompose", "demo", "-o", str(out), "--align", *args]) == 0
    text = capsys.readouterr().out
    assert "alignment: relative distance" in text and "mlp.gate_proj" in text
    manifest = json.loads((out / "attnquant.json").read_text())
    assert manifest["aligned"]["applied"] and manifest["source"]["path"] == str(demo)
    assert (out / ALIGN_MANIFEST_FILE).is_file()
    assert not list(tmp_path.glob(".aligned-theta.*"))  # the aligned copy is gone
    theta = ThetaCheckpoint.open(out)
    rebuilt = dict(theta.rebuilt_state())
    dense = open_checkpoint(demo)
    original = {k: dense.get(k) for k in dense.keys()}
    assert rebuilt.keys() == original.keys()
    if args[0] == "--blocks":
        config = json.loads((demo / "config.json").read_text())
        ids = [5, 17, 300, 42, 7, 1999, 64, 128, 3, 77, 250, 11]
        want = llama_logits(config, original, ids)
        got = llama_logits(config, rebuilt, ids)
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
        moved = [k for k in original if not np.array_equal(rebuilt[k], original[k])]
        assert moved  # alignment changed the parametrisation...
        restored = unalign_state(rebuilt, load_align_transforms(out))
        for key, array in original.items():  # ...and the record takes it back
            np.testing.assert_allclose(restored[key], array, rtol=0, atol=1e-5)


def test_decompose_align_refuses_an_existing_output(src, tmp_path, capsys):
    out = tmp_path / "theta"
    out.mkdir()
    assert cli(["decompose", str(src), "-o", str(out), "--align"]) == 2
    assert "already exists" in capsys.readouterr().err
