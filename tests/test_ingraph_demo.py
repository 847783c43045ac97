"""The in-graph paths on the demo model (GEMM, fold-in-graph, custom op) against precompute-outside."""

from __future__ import annotations

import dataclasses

import pytest

from attnquant_cli._prompts import VERIFY_PROMPTS
from attnquant_max import AttnquantConfig, load_pipeline, logit_parity

OUTSIDE = AttnquantConfig()
GEMM = dataclasses.replace(OUTSIDE, precompute_outside=False, gemm=True)
FOLD = dataclasses.replace(OUTSIDE, precompute_outside=False, precompute=True)
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
def test_ingraph_paths_agree_with_precompute_outside_when_compressed(theta_dir):
    theta = theta_dir(1, 16)
    with load_pipeline(theta, config=OUTSIDE, **COMMON) as outside:
        for config in (GEMM, FOLD, CUSTOM):
            with load_pipeline(theta, config=config, **COMMON) as ingraph:
                report = _parity(outside, ingraph)
            assert report.max_abs_logprob_delta < 1e-2, config
            assert report.agreement >= 0.9, config


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
