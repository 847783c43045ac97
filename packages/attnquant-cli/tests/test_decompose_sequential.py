"""attnquant decompose --calibration-data [--sequential/--no-sequential], on a tiny Llama with a
byte-level tokenizer (the demo's decompositions take minutes on a busy 2-core machine)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from attnquant_cli import cli
from attnquant_core import MANIFEST_FILE, ThetaCheckpoint
from attnquant_core.calib import read_texts, token_stream, token_windows, windows_digest
from attnquant_core.testing import byte_llama_config

LAYERS, VOCAB = 3, 257
CONFIG = byte_llama_config(LAYERS, VOCAB)
FEW = ["--samples", "4", "--seq-len", "16"]


@pytest.fixture(scope="module")
def tiny(byte_llama) -> tuple[Path, str]:
    """A 3-layer byte-level Llama and a text (conftest's ``byte_llama``)."""
    return byte_llama(LAYERS)


def _manifest(path: Path) -> dict:
    return json.loads((path / MANIFEST_FILE).read_text())


@pytest.mark.parametrize("sequential", [[], ["--sequential"], ["--no-sequential"]])
def test_decompose_with_calibration_data(
    tmp_path: Path, capsys, tiny, sequential: list[str]
) -> None:
    model, data = tiny
    out = tmp_path / "theta"
    rc = cli(
        [
            "decompose",
            str(model),
            "-o",
            str(out),
            "--rank",
            "2",
            "--calibration-data",
            data,
            *FEW,
            *sequential,
            "--json",
        ]
    )
    assert rc == 0, capsys.readouterr().err
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    record = _manifest(out)["calibration"]
    assert summary["calibration"] == record
    windows = token_windows(  # the text pipeline of `attnquant calibrate`
        token_stream(model, read_texts([data]), CONFIG), seq_len=16, samples=4, seed=0
    )
    assert record["tokens"] == 64 and record["sequences"] == 4 and record["seq_len"] == 16
    assert record["data"] == [data]
    assert record["sequential"] is (sequential != ["--no-sequential"])
    assert record["data_digest"] == windows_digest(windows)
    theta = ThetaCheckpoint.open(out)
    assert theta.rebuild("mlp.down_proj", LAYERS - 1).shape == (24, 40)


def test_same_data_same_digest(tmp_path: Path, tiny) -> None:
    model, data = tiny
    outs = [tmp_path / "a", tmp_path / "b"]
    for out, seq in zip(outs, ("--sequential", "--no-sequential"), strict=True):
        args = ["decompose", str(model), "-o", str(out), "--budget", "0.5"]
        assert cli([*args, "--calibration-data", data, *FEW, seq]) == 0
    a, b = (_manifest(o) for o in outs)
    assert a["calibration"]["data_digest"] == b["calibration"]["data_digest"]
    assert "allocation" in a["calibration"] and a["budget"]["stored_over_dense"] <= 0.5
    assert {n: f["ranks"] for n, f in a["families"].items()} == {
        n: f["ranks"] for n, f in b["families"].items()
    }


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--calibration", "stats.safetensors", "--calibration-data", "t.txt"], "give one"),
        (["--sequential"], "--sequential needs --calibration-data"),
        (["--sequential", "--calibration", "stats.safetensors"], "--calibration-data"),
        (["--samples", "4"], "--samples/--seq-len apply to --calibration-data"),
        (["--calibration-data", "t.txt", "--align"], "--align"),
    ],
)
def test_refusals_write_nothing(tmp_path: Path, capsys, args: list[str], message: str) -> None:
    out = tmp_path / "theta"
    assert cli(["decompose", "demo", "-o", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_sequential_refused_for_an_architecture_the_forward_does_not_run(
    tmp_path: Path, capsys, tiny
) -> None:
    source, data = tiny
    model = tmp_path / "model"
    model.mkdir()
    for name in ("model.safetensors", "tokenizer.json"):
        (model / name).symlink_to(source / name)
    (model / "config.json").write_text(
        json.dumps({**CONFIG, "architectures": ["GPTNeoXForCausalLM"]})
    )
    out = tmp_path / "theta"
    rc = cli(["decompose", str(model), "-o", str(out), "--calibration-data", data, "--sequential"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--sequential" in err and "GPTNeoXForCausalLM" in err
    assert len(err.strip().splitlines()) == 1 and not out.exists()


def test_windows_digest_names_the_tokens() -> None:
    w = np.arange(32).reshape(2, 16)
    assert windows_digest(w) == windows_digest(w.copy()) != windows_digest(w.reshape(4, 8))
