"""`attnquant verify` on every execution path, through the CLI, on the tiny Llama of attnquant-max.

The tiny model, its bundle and its serving size are those of attnquant-max's tests
(:mod:`attnquant_max.testing`), so every graph here is one that session already compiled: MAX's
cache serves it in seconds, and a cold CI compiles each path's graph once. The demo model is
served end to end by the stock path only (``test_serve_e2e.py``); each in-graph path is the same
code on any Llama, and its numerics are checked against the numpy identity layer by layer
(``packages/attnquant-max/tests/test_layers.py``) and against precompute-outside as a whole
model (``test_ingraph.py``). What is checked here is what a user runs: the command, its
environment variables, its report and its exit code.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.numpy import load_file

from attnquant_cli import cli
from attnquant_max import PATH_DESCRIPTIONS
from attnquant_max.testing import (
    LAYERS,
    MAX_BATCH_SIZE,
    MAX_LENGTH,
    PROJECTIONS,
    tiny_llama_tensors,
    write_tiny_bundle,
    write_tiny_llama,
)

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("tiny")]

SIZES = ["--max-length", str(MAX_LENGTH), "--max-batch-size", str(MAX_BATCH_SIZE)]
PATHS = {
    "gemm": {"ATTNQUANT_PRECOMPUTE_OUTSIDE": "0", "ATTNQUANT_GEMM": "1"},
    "custom-op": {"ATTNQUANT_PRECOMPUTE_OUTSIDE": "0", "ATTNQUANT_GEMM": "0"},
    "precompute": {"ATTNQUANT_PRECOMPUTE": "1"},
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "dense")


@pytest.fixture(scope="module")
def bundle(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_bundle(tiny, tmp_path_factory.mktemp("tiny") / "bundle")


def _verify(base: Path, theta: Path, tmp_path: Path, capsys) -> tuple[int, dict, str]:
    report = tmp_path / "verify.json"
    code = cli(
        ["verify", str(base), str(theta), "-o", str(report), "--max-new-tokens", "8", *SIZES]
    )
    return code, json.loads(report.read_text()), capsys.readouterr().out


@pytest.mark.parametrize("path", list(PATHS))
def test_verify_checks_an_in_graph_path_against_the_stock_path(
    path, bundle, tmp_path, capsys, monkeypatch, caplog
):
    """`attnquant verify B B` with a path's variables: the base side of verify is always the
    stock path, so this is the path against precompute-outside on the same bundle."""
    for name, value in PATHS[path].items():
        monkeypatch.setenv(name, value)
    with caplog.at_level("INFO"):
        code, report, text = _verify(bundle, bundle, tmp_path, capsys)
    assert code == 0, text
    assert report["agreement"] == 1.0
    assert report["max_abs_logprob_delta"] < 1e-2
    assert "verdict: native-equivalent" in text
    # The in-graph paths hold the theta checkpoint's tensors, not the rebuilt dense weights.
    held = sum(a.nbytes for f in bundle.glob("*.safetensors") for a in load_file(f).values())
    assert report["theta_weight_bytes"] == held
    assert report["base_weight_bytes"] == sum(a.nbytes for a in tiny_llama_tensors().values())
    assert f"on the {PATH_DESCRIPTIONS[path]}" in caplog.text  # the theta side's start-up line


def test_verify_nvfp4_reports_real_numbers(tiny, tmp_path, capsys, monkeypatch, caplog):
    """ATTNQUANT_QUANT=nvfp4 against float32: numbers and the bytes held, not a verdict."""
    monkeypatch.setenv("ATTNQUANT_QUANT", "nvfp4")
    # The fused op, named so that CI compiles one known graph (auto times both forms first).
    monkeypatch.setenv("ATTNQUANT_NVFP4_KERNEL", "fused")
    with caplog.at_level("INFO"):
        code, report, text = _verify(tiny, tiny, tmp_path, capsys)
    assert "dequantized inside the graph" in caplog.text  # the plan line names both forms
    assert "fused (--nvfp4-kernel)" in caplog.text
    assert 0.0 < report["max_abs_logprob_delta"] < float("inf")  # the quantized path ran
    assert 0.0 <= report["agreement"] <= 1.0
    assert code == (0 if report["native_equivalent"] else 1)
    # Every projection: 4 B per float32 -> 0.5 B code + 1/16 B scale; 4 B per tensor, and fused
    # in float32 q/k/v and gate/up are one tensor each with a 4 B row scale (NVFP4MergedLinear).
    elements = LAYERS * sum(o * i for o, i in PROJECTIONS.values())
    merged = [f"self_attn.{p}_proj" for p in "qkv"] + ["mlp.gate_proj", "mlp.up_proj"]
    rows = sum(PROJECTIONS[f][0] for f in merged)
    per_tensor = len(PROJECTIONS) - len(merged) + 2
    packed = elements // 2 + elements // 16 + 4 * LAYERS * (per_tensor + rows)
    assert report["base_weight_bytes"] - report["theta_weight_bytes"] == 4 * elements - packed
    assert "weights held" in text
