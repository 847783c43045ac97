"""The in-graph paths on the demo model (GEMM at passthrough, custom op) against the stock model."""

from __future__ import annotations

import dataclasses

import pytest

from attnquant_cli._prompts import VERIFY_PROMPTS
from attnquant_max import AttnquantConfig, load_pipeline, logit_parity

OUTSIDE = AttnquantConfig()
GEMM = dataclasses.replace(OUTSIDE, precompute_outside=False, gemm=True)
CUSTOM = dataclasses.replace(OUTSIDE, precompute_outside=False, gemm=False)
COMMON = {"max_length": 512, "max_batch_size": 8}


def _parity(base, theta):
    return logit_parity(base, theta, list(VERIFY_PROMPTS[:4]), 16, **COMMON)


@pytest.mark.slow
def test_gemm_at_passthrough_matches_the_stock_model(demo, theta_dir):
    with (
        load_pipeline(demo, config=OUTSIDE, **COMMON) as base,
        load_pipeline(theta_dir("layers", 0), config=GEMM, **COMMON) as gemm,
    ):
        report = _parity(base, gemm)
    assert report.max_abs_logprob_delta < 1e-2
    assert report.agreement == 1.0


@pytest.mark.slow
def test_custom_op_agrees_with_precompute_outside_when_compressed(theta_dir):
    """G = 1, r = 16: the same greedy tokens. (GEMM and fold-in-graph are checked against
    precompute-outside at G = 1, r = 16 on the tiny model in attnquant-max's tests: each demo
    graph is minutes of cold compile in CI.)"""
    theta = theta_dir(1, 16)
    with (
        load_pipeline(theta, config=OUTSIDE, **COMMON) as outside,
        load_pipeline(theta, config=CUSTOM, **COMMON) as custom,
    ):
        report = _parity(outside, custom)
    assert report.max_abs_logprob_delta < 1e-2
    assert report.agreement == 1.0


@pytest.mark.slow
def test_custom_op_at_passthrough_passes_verify(demo, theta_dir, tmp_path, capsys, monkeypatch):
    """`attnquant verify` of the demo served on the custom-op path (greedy agreement 100%)."""
    import json

    from attnquant_cli import cli

    monkeypatch.setenv("ATTNQUANT_PRECOMPUTE_OUTSIDE", "0")
    monkeypatch.setenv("ATTNQUANT_GEMM", "0")
    out = tmp_path / "verify.json"
    assert cli(["verify", str(demo), str(theta_dir("layers", 0)), "-o", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["agreement"] == 1.0
    assert report["max_abs_logprob_delta"] < 1e-2
    assert "verdict: native-equivalent" in capsys.readouterr().out
