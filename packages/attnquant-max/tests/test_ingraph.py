"""The in-graph paths served end to end: the tiny Llama on CPU, against precompute-outside.

Three graphs beyond the stock one (GEMM at passthrough r=4, GEMM and in-graph
precompute at G=1 r=16): ~2-6 min cold on two cores, seconds from the cache.
The matmul counts and weight bytes are read from traced (not compiled) graphs.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from attnquant_max import (
    AttnquantConfig,
    LoadedModel,
    count_matmuls,
    decoder_graph,
    greedy_generate,
    logit_parity,
)

from .conftest import LAYERS, load_tiny

pytestmark = pytest.mark.slow

PROMPTS = ["hello world", "The quick brown fox", "attnquant"]
GEMM = AttnquantConfig(precompute_outside=False, gemm=True)
PRECOMPUTE = AttnquantConfig(precompute=True)
CUSTOM = AttnquantConfig(precompute_outside=False, gemm=False)


@pytest.fixture(scope="module")
def gemm_passthrough(tiny_theta: Path) -> Iterator[LoadedModel]:
    with load_tiny(tiny_theta, GEMM) as model:
        yield model


@pytest.fixture(scope="module")
def outside_g1(tiny_theta_g1_r16: Path) -> Iterator[LoadedModel]:
    with load_tiny(tiny_theta_g1_r16) as model:
        yield model


@pytest.fixture(scope="module")
def gemm_g1(tiny_theta_g1_r16: Path) -> Iterator[LoadedModel]:
    with load_tiny(tiny_theta_g1_r16, GEMM) as model:
        yield model


@pytest.fixture(scope="module")
def precompute_g1(tiny_theta_g1_r16: Path) -> Iterator[LoadedModel]:
    with load_tiny(tiny_theta_g1_r16, PRECOMPUTE) as model:
        yield model


@pytest.fixture(scope="module")
def custom_g1(tiny_theta_g1_r16: Path) -> Iterator[LoadedModel]:
    with load_tiny(tiny_theta_g1_r16, CUSTOM) as model:
        yield model


def _pipeline_model(model: LoadedModel) -> Any:
    return model.model.pipeline._pipeline_model


def test_gemm_path_builds_the_theta_model(
    gemm_passthrough: LoadedModel, theta_model: LoadedModel
) -> None:
    from attnquant_max import ThetaLlama3Model

    pm = _pipeline_model(gemm_passthrough)
    assert isinstance(pm, ThetaLlama3Model)
    assert "attnquant.gemm.self_attn.qkv_proj.0.W0V" in pm.state_dict
    assert "layers.1.mlp.down_proj.theta_U" in pm.state_dict
    assert not any(k.endswith("q_proj.weight") for k in pm.state_dict)
    assert not any(k.startswith("attnquant.") for k in _pipeline_model(theta_model).state_dict)


def test_gemm_at_passthrough_serves_the_same_greedy_tokens(
    gemm_passthrough: LoadedModel, theta_model: LoadedModel, dense_model: LoadedModel
) -> None:
    for prompt in PROMPTS:
        ids = theta_model.encode(prompt)
        expected = greedy_generate(theta_model, ids, 12)
        assert greedy_generate(gemm_passthrough, ids, 12) == expected
    report = logit_parity(dense_model, gemm_passthrough, PROMPTS, 8)
    assert report.agreement == 1.0
    assert report.max_abs_logprob_delta < 1e-2
    assert report.native_equivalent


@pytest.mark.parametrize("path", ["gemm", "precompute", "custom"])
def test_in_graph_paths_agree_with_precompute_outside_at_g1_r16(
    path: str, outside_g1: LoadedModel, request: pytest.FixtureRequest
) -> None:
    in_graph = request.getfixturevalue(f"{path}_g1")
    report = logit_parity(outside_g1, in_graph, PROMPTS, 8)
    assert report.max_abs_logprob_delta < 1e-2, report
    assert report.agreement == 1.0


def test_gemm_path_is_logged_once(tiny_theta: Path, caplog: pytest.LogCaptureFixture) -> None:
    from attnquant_max import log_serving_path, plan_serving

    plan = plan_serving(tiny_theta, GEMM)
    with caplog.at_level(logging.INFO, logger="attnquant_max"):
        line = log_serving_path(plan)
    assert "GEMM formulation" in line and "ATTNQUANT_GEMM=1" in line


def _per_layer(config: AttnquantConfig, loaded: LoadedModel) -> tuple[float, int, int]:
    graph, weight_bytes = decoder_graph(loaded, config)
    total = sum(count_matmuls(graph).values())
    return (total - 1) / LAYERS, total, weight_bytes  # 1: the LM head


def _checkpoint_bytes(path: Path) -> int:
    import safetensors.numpy

    return sum(
        a.nbytes
        for f in path.glob("*.safetensors")
        for a in safetensors.numpy.load_file(f).values()
    )


def test_matmuls_per_layer_and_weight_bytes(
    outside_g1: LoadedModel, dense_model: LoadedModel, tiny_theta_g1_r16: Path, tiny_dense: Path
) -> None:
    """Read from the traced IR: the table of the closing note."""
    rows = {
        "precompute-outside": _per_layer(AttnquantConfig(), outside_g1),
        "gemm, fused": _per_layer(GEMM, outside_g1),
        "gemm, unfused": _per_layer(dataclasses.replace(GEMM, qkv_fuse=False), outside_g1),
        "precompute in graph, fused": _per_layer(PRECOMPUTE, outside_g1),
        "custom op, fused MLP": _per_layer(CUSTOM, outside_g1),
    }
    for name, (per_layer, total, nbytes) in rows.items():
        print(f"{name:28s} matmuls/layer {per_layer:5.1f} (total {total}), weight bytes {nbytes}")
    assert rows["precompute-outside"][0] == 4  # qkv, o, gate_up, down
    assert rows["gemm, fused"][0] == 8  # two per group
    assert rows["gemm, unfused"][0] == 14  # two per projection
    assert rows["precompute in graph, fused"][0] == 4 + 7  # + U V^T per projection
    assert rows["custom op, fused MLP"][0] == 0  # generated_linear x4, generated_mlp x1
    graph, _ = decoder_graph(outside_g1, CUSTOM)
    text = str(graph)
    assert text.count('"generated_linear"') == 4 * LAYERS, "q, k, v, o per layer"
    assert text.count('"generated_mlp"') == LAYERS
    # Precompute-outside holds the dense model; the in-graph paths hold the theta
    # checkpoint's tensors, nothing more (W0 once per band, V inside the band weight).
    dense = _checkpoint_bytes(tiny_dense)
    assert rows["precompute-outside"][2] == dense == _pipeline_model(dense_model).weight_bytes
    theta = _checkpoint_bytes(tiny_theta_g1_r16)
    for name in (
        "gemm, fused",
        "gemm, unfused",
        "precompute in graph, fused",
        "custom op, fused MLP",
    ):
        assert rows[name][2] == theta, name
