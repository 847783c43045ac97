"""``attnquant eval --forward max`` against the numpy forward on the demo model.

MAX returns every prompt position's logits only from a model built with ``enable_echo``: a
graph of its own (``ReturnLogits.ALL``), not the stock demo graph the other MAX tests share, so
this one test has its own ``xdist_group`` and compiles it once (a theta checkpoint rebuilt at
load uses the same graph).
"""

from __future__ import annotations

import json

import pytest

from attnquant_cli import cli

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("demo-eval-max")]


def _eval(capsys, *args: str) -> dict:
    capsys.readouterr()
    common = ["--seq-len", "128", "--samples", "4", "--json"]
    assert cli(["eval", *args, *common]) == 0
    return json.loads(capsys.readouterr().out)


def test_max_eval_agrees_with_the_numpy_forward(demo, theta_dir, capsys):
    theta = str(theta_dir(1, 8))  # lossy: KL and top-1 below 1 are real figures
    # The stock graph's echo build (the one `attnquant serve` of the demo compiles): a
    # compressed checkpoint would be served in the graph by default.
    through_max = _eval(capsys, "demo", theta, "--forward", "max", "--path", "precompute-outside")
    through_numpy = _eval(capsys, "demo", theta, "--forward", "numpy")
    assert through_max["forward"] == "max" and through_numpy["forward"] == "numpy"
    assert through_max["tokens"] == through_numpy["tokens"] == 4 * 127
    for m, n in zip(through_max["results"], through_numpy["results"], strict=True):
        assert set(m["forward"].values()) == {"max"}
        assert m["perplexity"] == pytest.approx(n["perplexity"], rel=1e-3)
        assert m["top1_agreement"] == n["top1_agreement"]  # float32 both: the same argmax
        assert m["kl"] == pytest.approx(n["kl"], rel=1e-2, abs=1e-5)
    base, lossy = through_max["results"]
    assert base["top1_agreement"] == 1.0 and base["kl"] == 0.0
    assert lossy["kl"] > 1e-3 and lossy["perplexity_ratio"] > 1.0


def test_decode_steps_score_windows_as_the_echo_forward_does(demo, theta_dir, capsys):
    """``--decode-steps``: each window token by token on the serving graph (KV cache, one row a
    step, teacher-forced) gives the echo model's all-position figures, as float32 allows."""
    theta = str(theta_dir(1, 8))
    common = ("--forward", "max", "--path", "precompute-outside")
    echo = _eval(capsys, "demo", theta, *common)
    steps = _eval(capsys, "demo", theta, *common, "--decode-steps")
    assert steps["decode_steps"] is True and echo["decode_steps"] is False
    assert steps["tokens"] == echo["tokens"] == 4 * 127
    for s, e in zip(steps["results"], echo["results"], strict=True):
        assert s["perplexity"] == pytest.approx(e["perplexity"], rel=1e-4)
        assert s["top1_agreement"] == pytest.approx(e["top1_agreement"], abs=2 / 508)
        assert s["kl"] == pytest.approx(e["kl"], rel=1e-2, abs=1e-5)


def test_the_base_is_the_reference_unquantized_and_the_others_are_quantized_at_load(demo, capsys):
    """``eval demo demo --quant nvfp4 --quant-head --quant-embedding``: the base is served as it
    is (the figures of ``eval demo`` alone), the second checkpoint with every weight, head and
    table in NVFP4, so its KL and agreement are against the float model."""
    common = ("--forward", "max", "--nvfp4-kernel", "dequantize")
    alone = _eval(capsys, "demo", *common)
    quant = ("--quant", "nvfp4", "--quant-head", "--quant-embedding")
    base, quantized = _eval(capsys, "demo", "demo", *common, *quant)["results"]
    assert base["perplexity"] == pytest.approx(alone["results"][0]["perplexity"], rel=1e-6)
    assert base["kl"] == 0.0 and base["top1_agreement"] == 1.0
    assert quantized["kl"] > 1e-4 and quantized["top1_agreement"] < 1.0
    assert quantized["perplexity_ratio"] != 1.0
