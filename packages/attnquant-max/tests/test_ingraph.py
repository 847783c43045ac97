"""The in-graph paths served end to end: the tiny Llama on CPU, against precompute-outside.

One whole-model graph per path (GEMM, in-graph precompute, custom op) beyond the stock one, all
on one bundle (:func:`attnquant_max.testing.write_tiny_bundle`): one W0 per layer, as at
passthrough, the production shape and the cheapest to compile (every layer's theta ops are
alike), with a scale s != 1 and a rank-16 correction U V^T at work in every projection, so every
term of the identity runs (~1-2 min cold per path on two cores, seconds from the cache). The
matmul counts and weight bytes are read from traced (not compiled) graphs.

What moved: the GEMM path at passthrough against the stock model had a graph of its own, and
the in-graph paths had another bundle (G = 1, one W0 shared by both layers). Passthrough is this
bundle's shape with s = 1 and U V^T = 0, and its precompute-outside rebuild is bit-exact to the
dense weights (``test_weights.py::test_theta_at_passthrough_rebuilds_the_dense_weights_exactly``),
so "each in-graph path == precompute-outside on this bundle" covers "in-graph at passthrough ==
the stock model". A band W0 shared by several layers (slots, one weight held once) is checked
against the numpy identity to 1e-4 in the layer graph of ``test_layers.py`` and in the layout
test there; the CLI runs every path through ``attnquant verify`` in ``tests/test_paths_cli.py``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from attnquant_core.serving import FUSED_GROUPS
from attnquant_max import (
    LoadedModel,
    ParityReport,
    ServingOptions,
    count_matmuls,
    decoder_graph,
    greedy_generate,
    logit_parity,
)
from attnquant_max.testing import VOCAB

from .conftest import HIDDEN, LAYERS, load_tiny

# One xdist group per path (conftest.py): the three paths compile on two workers side by side.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("gemm")]

PROMPTS = ["hello world", "The quick brown fox", "attnquant"]
GEMM = ServingOptions(path="gemm")
PRECOMPUTE = ServingOptions(path="precompute")
CUSTOM = ServingOptions(path="custom-op")
PATHS = {"gemm": GEMM, "precompute": PRECOMPUTE, "custom": CUSTOM}


@pytest.fixture(scope="module")
def outside_bundle(tiny_bundle: Path) -> Iterator[LoadedModel]:
    """The bundle rebuilt once at load: the stock graph (shared with the dense model)."""
    with load_tiny(tiny_bundle) as model:
        yield model


@pytest.fixture(
    scope="module", params=[pytest.param(p, marks=pytest.mark.xdist_group(p)) for p in PATHS]
)
def in_graph(request: pytest.FixtureRequest, tiny_bundle: Path) -> Iterator[LoadedModel]:
    """The bundle on each in-graph path; one model open at a time (pytest groups the tests
    of one path together, so each path's model loads once)."""
    with load_tiny(tiny_bundle, PATHS[request.param]) as model:
        yield model


def _pipeline_model(model: LoadedModel) -> Any:
    return model.model.pipeline._pipeline_model


def test_in_graph_paths_build_the_theta_model(
    in_graph: LoadedModel, theta_model: LoadedModel, request: pytest.FixtureRequest
) -> None:
    """Every in-graph path builds attnquant's model, holding theta tensors and no dense weight;
    the GEMM path holds ``W0`` and the ``V``s of a band in one weight per band."""
    from attnquant_max import ThetaLlama3Model

    pm = _pipeline_model(in_graph)
    assert isinstance(pm, ThetaLlama3Model)
    assert not any(k.endswith("q_proj.weight") for k in pm.state_dict)
    assert "layers.1.mlp.down_proj.theta_U" in pm.state_dict
    if request.node.callspec.params["in_graph"] == "gemm":
        assert "attnquant.gemm.self_attn.qkv_proj.0.W0V" in pm.state_dict
        assert "attnquant.gemm.self_attn.qkv_proj.1.W0V" in pm.state_dict  # the second band
    else:
        assert not any(k.startswith("attnquant.gemm.") for k in pm.state_dict)
    assert not any(k.startswith("attnquant.") for k in _pipeline_model(theta_model).state_dict)


def test_in_graph_paths_agree_with_precompute_outside(
    in_graph: LoadedModel, outside_bundle: LoadedModel
) -> None:
    """Same bundle, same greedy tokens; log-probabilities within float32 reassociation."""
    assert _same_model(outside_bundle, in_graph, 1e-2).native_equivalent


def _same_model(reference: LoadedModel, served: LoadedModel, tolerance: float) -> ParityReport:
    """``served`` gives ``reference``'s greedy tokens on every prompt, and its log-probabilities
    within ``tolerance``; the parity report."""
    for prompt in PROMPTS:
        ids = reference.encode(prompt)
        assert greedy_generate(served, ids, 12) == greedy_generate(reference, ids, 12)
    report = logit_parity(reference, served, PROMPTS, 8)
    assert report.max_abs_logprob_delta < tolerance, report
    assert report.agreement == 1.0
    return report


def test_gemm_path_is_logged_once(tiny_theta: Path, caplog: pytest.LogCaptureFixture) -> None:
    from attnquant_max import log_serving_path, plan_serving

    plan = plan_serving(tiny_theta, GEMM)
    with caplog.at_level(logging.INFO, logger="attnquant_max"):
        line = log_serving_path(plan)
    assert "GEMM formulation" in line and "--path gemm" in line


def _per_layer(config: ServingOptions, loaded: LoadedModel) -> tuple[float, int, int]:
    graph, weight_bytes = decoder_graph(loaded, config)
    total = sum(count_matmuls(graph).values())
    return (total - 1) / LAYERS, total, weight_bytes  # 1: the LM head


def _expected_matmuls(layout: Any, layer: int) -> int:
    """Matmuls of one decoder layer as the layout says it is served (GEMM path)."""

    def alone(family: str) -> int:
        how = layout.served[family][layer]
        if how.kind == "banded":
            return 1 + (how.rank > 0)
        return {"dense": 1, "zero": 0}.get(how.kind, 2)

    n = alone("self_attn.o_proj") + alone("mlp.down_proj")
    for group, members in FUSED_GROUPS.items():
        if layout.groups.get(group) == members:  # banded, one band weight
            n += 1 + (sum(layout.served[m][layer].rank for m in members) > 0)
        elif layer in layout.stacked.get(group, ()):  # one stacked first matmul
            n += 1 + sum(layout.served[m][layer].kind != "dense" for m in members)
        else:
            n += sum(alone(m) for m in members)
    return n


def test_budget_checkpoint_on_the_gemm_path_holds_its_stored_bytes(tiny_budget: Path) -> None:
    """Traced, not compiled: a checkpoint fitted to a budget (low rank, shared bases, banded)
    builds on the GEMM path holding the checkpoint's tensors (dense weights only for layers
    whose factors are not smaller), each basis once, with the matmuls its forms need."""
    from attnquant_core import FAMILIES
    from attnquant_core.serving import InGraphLayout
    from attnquant_max.testing import gemm_weight_bytes

    # Precompute-outside: the stock graph, already in the cache; decoder_graph re-plans it.
    with load_tiny(tiny_budget) as outside:
        graph, nbytes = decoder_graph(outside, GEMM)
        pm = _pipeline_model(outside)
        state = dataclasses.replace(pm.adapter, options=GEMM)(
            dict(pm.weights.items()),
            huggingface_config=pm.huggingface_config,
            pipeline_config=pm.pipeline_config,
        )
    assert nbytes == gemm_weight_bytes(tiny_budget)
    layout = InGraphLayout.from_state({k: v.shape for k, v in state.items()}, FAMILIES, fuse=True)
    assert layout is not None and layout.gemm
    assert any(k != "banded" for how in layout.forms.values() for k in how)
    text = str(graph)
    for key in (k for k in state if k.endswith((".basis", ".W0V"))):
        assert text.count(f'"{key}"') == 1, key
    want = 1 + sum(_expected_matmuls(layout, i) for i in range(LAYERS))  # 1: the LM head
    assert sum(count_matmuls(graph).values()) == want
    print(f"budget 0.5 on the GEMM path: {want} matmuls, {nbytes} weight bytes, {layout.forms}")


def _checkpoint_bytes(path: Path) -> int:
    import safetensors.numpy

    return sum(
        a.nbytes
        for f in path.glob("*.safetensors")
        for a in safetensors.numpy.load_file(f).values()
    )


def test_matmuls_per_layer_and_weight_bytes(
    outside_bundle: LoadedModel, dense_model: LoadedModel, tiny_bundle: Path, tiny_dense: Path
) -> None:
    """Read from the traced IR: the table of the closing note."""
    rows = {
        "precompute-outside": _per_layer(ServingOptions(path="precompute-outside"), outside_bundle),
        "gemm, fused": _per_layer(GEMM, outside_bundle),
        "gemm, unfused": _per_layer(dataclasses.replace(GEMM, qkv_fuse=False), outside_bundle),
        "precompute in graph, fused": _per_layer(PRECOMPUTE, outside_bundle),
        "custom op, fused MLP": _per_layer(CUSTOM, outside_bundle),
    }
    for name, (per_layer, total, nbytes) in rows.items():
        print(f"{name:28s} matmuls/layer {per_layer:5.1f} (total {total}), weight bytes {nbytes}")
    assert rows["precompute-outside"][0] == 4  # qkv, o, gate_up, down
    assert rows["gemm, fused"][0] == 8  # two per group
    assert rows["gemm, unfused"][0] == 14  # two per projection
    assert rows["precompute in graph, fused"][0] == 4 + 7  # + U V^T per projection
    assert rows["custom op, fused MLP"][0] == 0  # generated_linear x4, generated_mlp x1
    graph, _ = decoder_graph(outside_bundle, CUSTOM)
    text = str(graph)
    assert text.count('"generated_linear"') == 4 * LAYERS, "q, k, v, o per layer"
    assert text.count('"generated_mlp"') == LAYERS
    # Precompute-outside holds the dense model; the in-graph paths hold the theta
    # checkpoint's tensors, nothing more (W0 once per band, V inside the band weight).
    dense = _checkpoint_bytes(tiny_dense)
    assert rows["precompute-outside"][2] == dense == _pipeline_model(dense_model).weight_bytes
    theta = _checkpoint_bytes(tiny_bundle)
    for name in (
        "gemm, fused",
        "gemm, unfused",
        "precompute in graph, fused",
        "custom op, fused MLP",
    ):
        assert rows[name][2] == theta, name


def _custom_ops(text: str) -> dict[str, int]:
    return {op: text.count(f'"{op}"') for op in ("generated_linear", "generated_lowrank")}


def test_budget_checkpoint_on_the_custom_op_runs_one_dispatch_per_projection(
    tiny_budget: Path,
) -> None:
    """Traced, not compiled: banded layers run ``generated_linear``, every low-rank and
    shared-basis layer one ``generated_lowrank`` (no matmul but the head and the layers served
    dense), each basis held once, the checkpoint's bytes held."""
    from attnquant_core import ThetaCheckpoint
    from attnquant_core.serving import served_layers
    from attnquant_max.testing import gemm_weight_bytes

    ckpt = ThetaCheckpoint.open(tiny_budget)
    kinds = [h.kind for n in ckpt.families for h in served_layers(ckpt.family_theta(n))]
    if all(k == "banded" for k in kinds):
        pytest.skip("the budget chose banded theta for every family")  # pragma: no cover
    with load_tiny(tiny_budget) as outside:
        graph, nbytes = decoder_graph(outside, CUSTOM)
    text = str(graph)
    assert nbytes == gemm_weight_bytes(tiny_budget)
    factored = sum(k in ("lowrank", "basis_in", "basis_out") for k in kinds)
    assert _custom_ops(text) == {
        "generated_linear": kinds.count("banded"),
        "generated_lowrank": factored,
    }
    assert sum(count_matmuls(graph).values()) == 1 + kinds.count("dense")  # 1: the LM head
    for key in (k for k in text.split('"') if k.endswith(".basis")):
        assert text.count(f'"{key}"') == 1, key


def test_budget_checkpoint_with_an_nvfp4_head_runs_the_head_fused(tiny_budget: Path) -> None:
    """Traced: ``ATTNQUANT_QUANT_HEAD=1`` beside a budget fit's float forms on the custom op.
    The head becomes one fused NVFP4 dispatch (the LM head's matmul gone), every projection
    runs as without it, and the bytes held are the checkpoint's with the float32 head replaced
    by its 4.5 bits per weight."""
    from attnquant_kernels.layout import cpu_prefers_tiled
    from attnquant_max.testing import gemm_weight_bytes

    op = f'"generated_linear_nvfp4{"_tiled_a8" if cpu_prefers_tiled() else ""}"'  # --nvfp4-int8
    head = dataclasses.replace(CUSTOM, quant_head=True, nvfp4_kernel="fused")
    with load_tiny(tiny_budget) as outside:
        plain, _ = decoder_graph(outside, CUSTOM)
        graph, nbytes = decoder_graph(outside, head)
    text, before = str(graph), str(plain)
    assert text.count(op) == 1 and op not in before
    assert _custom_ops(text) == _custom_ops(before)
    assert sum(count_matmuls(graph).values()) == sum(count_matmuls(plain).values()) - 1
    float_head = VOCAB * HIDDEN * 4
    packed_head = VOCAB * HIDDEN // 2 + VOCAB * HIDDEN // 16 + 4
    assert nbytes == gemm_weight_bytes(tiny_budget) - float_head + packed_head


@pytest.mark.xdist_group("custom-budget")
def test_budget_checkpoint_on_the_custom_op_agrees_with_precompute_outside(
    tiny_budget: Path,
) -> None:
    """Compiled: every form (banded, low rank, a basis on either side) on the custom op serves
    the greedy tokens of the same checkpoint rebuilt at load, log-probabilities within float32
    reassociation."""
    with load_tiny(tiny_budget) as outside, load_tiny(tiny_budget, CUSTOM) as custom:
        report = _same_model(outside, custom, 1e-3)
    assert report.theta_weight_bytes < report.base_weight_bytes
    print(
        f"budget 0.5 on the custom op: max |dlogprob| {report.max_abs_logprob_delta:.2e}, "
        f"{report.theta_weight_bytes} of {report.base_weight_bytes} weight bytes"
    )


@pytest.mark.xdist_group("custom-dense")
def test_a_dense_checkpoint_on_the_custom_op_is_the_stock_model(
    tiny_dense: Path, dense_model: LoadedModel
) -> None:
    """Compiled: ``--path custom-op`` on a dense checkpoint (decomposed at load at passthrough:
    ``W0`` the weights, ``s = 1``, no correction) serves the stock model's greedy tokens with
    attnquant's float ops in place of MAX's matmul, holding the dense bytes. On the CPU this
    decodes a 300M model faster than the stock matmul (docs/serving-paths.md)."""
    from attnquant_max import plan_serving

    plan = plan_serving(tiny_dense, CUSTOM)
    assert (plan.source, plan.path, plan.blocks, plan.rank) == ("dense", "custom-op", "layers", 0)
    with load_tiny(tiny_dense, CUSTOM) as custom:
        text = str(decoder_graph(custom, CUSTOM)[0])
        assert text.count('"generated_linear"') == 4 * LAYERS
        assert text.count('"generated_mlp"') == LAYERS
        assert sum(count_matmuls(text).values()) == 1  # the LM head alone on MAX's matmul
        report = _same_model(dense_model, custom, 1e-3)
    assert report.theta_weight_bytes <= 1.01 * report.base_weight_bytes
    print(f"dense on the custom op: max |dlogprob| {report.max_abs_logprob_delta:.2e}")
