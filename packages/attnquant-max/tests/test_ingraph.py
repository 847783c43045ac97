"""The in-graph paths served end to end: the tiny Llama on CPU, against precompute-outside.

One whole-model graph per path (GEMM, in-graph precompute, custom op) beyond the stock one, all
on one bundle: G = 2 bands over three layers (layers 0-1 share a W0, layer 2 has its own) and
rank 16, so shared and single-layer bands, the scale and the low-rank correction all run in the
one compile of each path (~1-2 min cold on two cores, seconds from the cache). The matmul counts
and weight bytes are read from traced (not compiled) graphs.

Passthrough needs no graph of its own: it is the same identity with one layer per band, and the
rebuild it serves on precompute-outside is bit-exact to the dense weights
(``test_weights.py::test_theta_at_passthrough_rebuilds_the_dense_weights_exactly``), so "in-graph
path == precompute-outside on a bundle with shared and single-layer bands" covers "in-graph at
passthrough == the stock model". The layer-level graph of ``test_layers.py`` checks the GEMM and
precompute layers against the numpy identity to 1e-4 on top of that.
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
PATHS = {"gemm": GEMM, "precompute": PRECOMPUTE, "custom": CUSTOM}


@pytest.fixture(scope="module")
def outside_banded(tiny_banded: Path) -> Iterator[LoadedModel]:
    """The banded bundle rebuilt once at load: the stock graph (shared with the dense model)."""
    with load_tiny(tiny_banded) as model:
        yield model


@pytest.fixture(scope="module", params=list(PATHS))
def in_graph(request: pytest.FixtureRequest, tiny_banded: Path) -> Iterator[LoadedModel]:
    """The banded bundle on each in-graph path; one model open at a time."""
    with load_tiny(tiny_banded, PATHS[request.param]) as model:
        yield model


@pytest.fixture(scope="module")
def gemm_banded(tiny_banded: Path) -> Iterator[LoadedModel]:
    with load_tiny(tiny_banded, GEMM) as model:
        yield model


def _pipeline_model(model: LoadedModel) -> Any:
    return model.model.pipeline._pipeline_model


def test_gemm_path_builds_the_theta_model(
    gemm_banded: LoadedModel, theta_model: LoadedModel
) -> None:
    from attnquant_max import ThetaLlama3Model

    pm = _pipeline_model(gemm_banded)
    assert isinstance(pm, ThetaLlama3Model)
    assert "attnquant.gemm.self_attn.qkv_proj.0.W0V" in pm.state_dict
    assert "attnquant.gemm.self_attn.qkv_proj.1.W0V" in pm.state_dict  # the second band
    assert "layers.2.mlp.down_proj.theta_U" in pm.state_dict
    assert not any(k.endswith("q_proj.weight") for k in pm.state_dict)
    assert not any(k.startswith("attnquant.") for k in _pipeline_model(theta_model).state_dict)


def test_in_graph_paths_agree_with_precompute_outside(
    in_graph: LoadedModel, outside_banded: LoadedModel
) -> None:
    """Same bundle, same greedy tokens; log-probabilities within float32 reassociation."""
    for prompt in PROMPTS:
        ids = outside_banded.encode(prompt)
        assert greedy_generate(in_graph, ids, 12) == greedy_generate(outside_banded, ids, 12)
    report = logit_parity(outside_banded, in_graph, PROMPTS, 8)
    assert report.max_abs_logprob_delta < 1e-2, report
    assert report.agreement == 1.0
    assert report.native_equivalent


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
    outside_banded: LoadedModel, dense_model: LoadedModel, tiny_banded: Path, tiny_dense: Path
) -> None:
    """Read from the traced IR: the table of the closing note."""
    rows = {
        "precompute-outside": _per_layer(AttnquantConfig(), outside_banded),
        "gemm, fused": _per_layer(GEMM, outside_banded),
        "gemm, unfused": _per_layer(dataclasses.replace(GEMM, qkv_fuse=False), outside_banded),
        "precompute in graph, fused": _per_layer(PRECOMPUTE, outside_banded),
        "custom op, fused MLP": _per_layer(CUSTOM, outside_banded),
    }
    for name, (per_layer, total, nbytes) in rows.items():
        print(f"{name:28s} matmuls/layer {per_layer:5.1f} (total {total}), weight bytes {nbytes}")
    assert rows["precompute-outside"][0] == 4  # qkv, o, gate_up, down
    assert rows["gemm, fused"][0] == 8  # two per group
    assert rows["gemm, unfused"][0] == 14  # two per projection
    assert rows["precompute in graph, fused"][0] == 4 + 7  # + U V^T per projection
    assert rows["custom op, fused MLP"][0] == 0  # generated_linear x4, generated_mlp x1
    graph, _ = decoder_graph(outside_banded, CUSTOM)
    text = str(graph)
    assert text.count('"generated_linear"') == 4 * LAYERS, "q, k, v, o per layer"
    assert text.count('"generated_mlp"') == LAYERS
    # Precompute-outside holds the dense model; the in-graph paths hold the theta
    # checkpoint's tensors, nothing more (W0 once per band, V inside the band weight).
    dense = _checkpoint_bytes(tiny_dense)
    assert rows["precompute-outside"][2] == dense == _pipeline_model(dense_model).weight_bytes
    theta = _checkpoint_bytes(tiny_banded)
    for name in (
        "gemm, fused",
        "gemm, unfused",
        "precompute in graph, fused",
        "custom op, fused MLP",
    ):
        assert rows[name][2] == theta, name
