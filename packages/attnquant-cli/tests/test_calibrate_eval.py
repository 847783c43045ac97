"""attnquant calibrate and attnquant eval on the demo model, a few tokens at a time."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
from scipy.special import log_softmax
from tokenizers import Tokenizer

from attnquant_cli import cli
from attnquant_cli._calibrate import DEMO_DATA
from attnquant_cli._demo import demo_model_path
from attnquant_core.calib import read_stats, read_texts
from attnquant_core.llama_reference import llama_logits

TEXT = "def add(a, b):\n    return a + b\n\n\nclass Point:\n    x = 0\n    y = 0\n" * 4


def _json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_calibrate_demo_writes_valid_statistics(tmp_path: Path, capsys) -> None:
    stats_file = tmp_path / "demo.stats.safetensors"
    rc = cli(
        ["calibrate", "demo", "-o", str(stats_file), "--samples", "2", "--seq-len", "16", "--json"]
    )
    assert rc == 0
    figures = _json(capsys)
    assert figures["tokens"] == 32 and figures["grams"] == 42 and figures["forward"] == "numpy"
    assert figures["data"] == [str(DEMO_DATA["calibration"])]  # the shipped training-split sample
    assert figures["peak_rss_bytes"] > 0
    stats = read_stats(stats_file)
    assert stats.tokens == 32 and len(stats) == 42 and figures["digest"] == stats.digest
    stats.validate()
    q = stats.gram("model.layers.0.self_attn.q_proj.weight", in_features=192)
    np.testing.assert_array_equal(q, stats.gram("model.layers.0.self_attn.v_proj.weight"))
    assert stats.shape("model.layers.5.mlp.down_proj.weight") == (512, 512)


def test_calibrate_needs_data_for_other_models(tmp_path: Path, capsys) -> None:
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (model / name).symlink_to(demo_model_path() / name)
    assert cli(["calibrate", str(model), "-o", str(tmp_path / "s.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "give the text to use with --data" in err and len(err.strip().splitlines()) == 1
    assert (
        cli(["calibrate", "demo", "-o", str(tmp_path / "s"), "--data", str(tmp_path / "no")]) == 2
    )
    assert "no such file or directory" in capsys.readouterr().err


def test_shipped_samples_are_disjoint_python_source() -> None:
    heldout, calibration = (
        read_texts([DEMO_DATA["heldout"]]),
        read_texts([DEMO_DATA["calibration"]]),
    )
    assert len(heldout) == 3 and len(calibration) == 5
    assert not set(heldout) & set(calibration)
    assert all("def " in text for text in heldout + calibration)
    assert (DEMO_DATA["heldout"].parent / "LICENSE-PSF.txt").is_file()


def test_eval_perplexity_equals_an_exact_computation(tmp_path: Path, capsys) -> None:
    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    rc = cli(
        [
            "eval",
            "demo",
            "--data",
            str(data),
            "--seq-len",
            "12",
            "--samples",
            "2",
            "--float64",
            "--json",
        ]
    )
    assert rc == 0
    got = _json(capsys)
    assert got["forward"] == "numpy" and got["windows"] == 2 and got["tokens"] == 22
    # Exact: the demo's tokenizer, BOS text EOS, the first two windows of 12, llama_logits.
    demo = demo_model_path()
    config = json.loads((demo / "config.json").read_text())
    state = safetensors.numpy.load_file(str(demo / "model.safetensors"))
    ids = [
        *Tokenizer.from_file(str(demo / "tokenizer.json")).encode(TEXT).ids,
        config["eos_token_id"],
    ]
    nll = 0.0
    for w in range(2):
        window = ids[12 * w : 12 * (w + 1)]
        lp = log_softmax(llama_logits(config, state, window), axis=-1)
        nll -= sum(lp[t, window[t + 1]] for t in range(11))
    (base,) = got["results"]
    assert base["perplexity"] == pytest.approx(math.exp(nll / 22), rel=1e-10)
    assert base["top1_agreement"] == 1.0 and base["kl"] == 0.0


def test_eval_judges_theta_checkpoints_against_the_base(tmp_path: Path, capsys) -> None:
    exact, lossy = tmp_path / "passthrough", tmp_path / "lossy"
    assert cli(["decompose", "demo", "-o", str(exact), "--blocks", "layers", "--rank", "0"]) == 0
    assert cli(["decompose", "demo", "-o", str(lossy), "--blocks", "1", "--rank", "4"]) == 0
    capsys.readouterr()
    rc = cli(
        [
            "eval",
            "demo",
            str(exact),
            str(lossy),
            "--seq-len",
            "16",
            "--samples",
            "2",
            "--forward",
            "numpy",
            "--json",
        ]
    )
    assert rc == 0
    got = _json(capsys)
    assert got["data"] == [str(DEMO_DATA["heldout"])]  # the shipped held-out sample
    base, same, worse = got["results"]
    assert [r["name"] for r in got["results"]] == ["demo", str(exact), str(lossy)]
    assert same["perplexity"] == pytest.approx(base["perplexity"], rel=1e-5)
    assert same["top1_agreement"] == 1.0 and same["kl"] < 1e-8
    assert worse["perplexity_ratio"] > 1.05 and worse["kl"] > 0.01 and worse["top1_agreement"] < 1


def test_decompose_with_calibration_records_it(tmp_path: Path, capsys) -> None:
    stats_file = tmp_path / "demo.stats.safetensors"
    assert (
        cli(["calibrate", "demo", "-o", str(stats_file), "--samples", "2", "--seq-len", "32"]) == 0
    )
    for extra in (["--budget", "0.8"], ["--blocks", "2", "--rank", "8"]):
        out = tmp_path / f"theta{len(extra)}{extra[1]}"
        rc = cli(["decompose", "demo", "-o", str(out), "--calibration", str(stats_file), *extra])
        assert rc == 0
        err = capsys.readouterr().err
        assert "fit for the output error over 64 calibration tokens (42 projections whitened" in err
        manifest = json.loads((out / "attnquant.json").read_text())
        assert manifest["calibration"]["digest"] == read_stats(stats_file).digest
    rc = cli(
        [
            "decompose",
            "demo",
            "-o",
            str(tmp_path / "x"),
            "--calibration",
            str(stats_file),
            "--align",
        ]
    )
    assert rc == 2 and "--calibration with --align" in capsys.readouterr().err
