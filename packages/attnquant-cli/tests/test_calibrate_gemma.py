"""attnquant calibrate, decompose --calibration and eval on a tiny Gemma 3 with a tokenizer."""

from __future__ import annotations

import json
import math
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from scipy.special import log_softmax
from tokenizers import Tokenizer

from attnquant_cli import cli
from attnquant_core.calib import read_stats
from attnquant_core.gemma_reference import gemma3_logits
from attnquant_core.tiny_gemma import write_tiny_gemma3

TEXT = "def add(a, b):\n    return a + b\n\n\nclass Point:\n    x = 0\n    y = 0\n"


def _json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_calibrate_decompose_and_eval_a_tiny_gemma3(tmp_path: Path, capsys) -> None:
    model = write_tiny_gemma3(tmp_path / "gemma3", tokenizer=True)
    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    stats_file = tmp_path / "gemma3.stats.safetensors"
    common = ["--data", str(data), "--samples", "2", "--seq-len", "16"]
    assert cli(["calibrate", str(model), "-o", str(stats_file), *common, "--json"]) == 0
    figures = _json(capsys)
    assert figures["tokens"] == 32 and figures["grams"] == 28 and figures["forward"] == "numpy"
    stats = read_stats(stats_file)
    stats.validate()
    assert stats.shape("model.layers.0.self_attn.o_proj.weight") == (64, 64)
    assert stats.shape("model.layers.3.mlp.down_proj.weight") == (128, 128)

    theta = tmp_path / "theta"
    decompose = ["decompose", str(model), "-o", str(theta), "--budget", "0.7"]
    assert cli([*decompose, "--calibration", str(stats_file)]) == 0
    capsys.readouterr()

    assert cli(["eval", str(model), str(theta), *common, "--float64", "--json"]) == 0
    got = _json(capsys)
    base, compressed = got["results"]
    assert got["windows"] == 2 and got["tokens"] == 30
    assert math.isfinite(base["perplexity"]) and math.isfinite(compressed["perplexity"])
    assert compressed["kl"] > 0 and base["kl"] == 0.0
    # Exact: the byte-level tokenizer, text then EOS, the first two windows of 16.
    config = json.loads((model / "config.json").read_text())
    state = safetensors.numpy.load_file(str(model / "model.safetensors"))
    ids = [*Tokenizer.from_file(str(model / "tokenizer.json")).encode(TEXT).ids, 257]
    nll = 0.0
    for w in range(2):
        window = np.asarray(ids[16 * w : 16 * (w + 1)])
        logits = gemma3_logits(config, state, window, embed_scale_dtype=ml_dtypes.bfloat16)
        lp = log_softmax(logits, axis=-1)
        nll -= sum(lp[t, window[t + 1]] for t in range(15))
    assert base["perplexity"] == pytest.approx(math.exp(nll / 30), rel=1e-10)
