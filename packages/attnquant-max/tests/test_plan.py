"""``--path auto``: the path follows the checkpoint, and the start-up line says why (no graph)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from attnquant_core import decompose_checkpoint
from attnquant_max import ServingOptions, plan_serving

AUTO = ServingOptions()


def _on_cpu(plan_path: str) -> None:
    if plan_path not in ("custom-op", "gemm"):  # pragma: no cover - not an in-graph plan
        raise AssertionError(plan_path)


def test_a_dense_checkpoint_is_served_on_the_stock_graph(tiny_dense: Path) -> None:
    plan = plan_serving(tiny_dense, AUTO)
    assert plan.path == "precompute-outside" and not plan.rebuilds
    assert "--path auto: a dense checkpoint is served on the stock graph" in plan.describe()


def test_a_passthrough_theta_checkpoint_is_served_on_the_stock_graph(tiny_theta: Path) -> None:
    plan = plan_serving(tiny_theta, AUTO)
    assert plan.path == "precompute-outside" and plan.passthrough
    assert "at passthrough" in plan.describe()


@pytest.mark.parametrize("fixture", ["tiny_theta_g1", "tiny_budget"])
def test_a_compressed_theta_checkpoint_is_served_in_the_graph(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    path = request.getfixturevalue(fixture)
    plan = plan_serving(path, AUTO)
    assert plan.in_graph
    _on_cpu(plan.path)
    line = plan.describe()
    assert "--path auto: a compressed theta checkpoint is served in the graph" in line
    assert "\n" not in line
    # Every held tensor is the checkpoint's own: fewer bytes than the dense weights.
    held = sum(a.nbytes for _, a in plan.theta_state())
    dense = sum(a.nbytes for _, a in plan.state())
    assert held < dense


def test_rank_is_for_a_dense_checkpoint_and_does_not_move_a_theta_one(tiny_theta_g1: Path) -> None:
    """``--rank`` sizes a decomposition at load; a theta checkpoint's own ranks pick the path."""
    assert plan_serving(tiny_theta_g1, ServingOptions(rank=128)).path == (
        plan_serving(tiny_theta_g1, AUTO).path
    )


def test_quantizing_at_load_keeps_a_compressed_checkpoint_on_the_stock_graph(
    tiny_theta_g1: Path,
) -> None:
    plan = plan_serving(tiny_theta_g1, ServingOptions(quant="nvfp4"))
    assert plan.path == "precompute-outside" and plan.quantized
    assert "--quant nvfp4" in plan.describe()


def test_an_nvfp4_w0_checkpoint_is_served_packed(
    tiny_dense: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    out = tmp_path_factory.mktemp("ckpt") / "v4"
    decompose_checkpoint(tiny_dense, out, blocks="layers", rank=4, quant="nvfp4")
    plan = plan_serving(out, AUTO)
    assert plan.nvfp4_w0 and plan.path == "gemm"
    assert "W0 is NVFP4 is served packed in the graph" in plan.describe()


def test_another_architecture_is_rebuilt_at_load_and_says_why(
    tiny_theta_g1: Path, tmp_path: Path
) -> None:
    """The in-graph theta model is Llama's: a compressed checkpoint of another architecture is
    rebuilt at load, the line naming why, instead of a refusal."""
    other = Path(shutil.copytree(tiny_theta_g1, tmp_path / "other"))
    config = json.loads((other / "config.json").read_text())
    config["architectures"] = ["Qwen2ForCausalLM"]
    (other / "config.json").write_text(json.dumps(config))
    plan = plan_serving(other, AUTO)
    assert plan.path == "precompute-outside"
    assert (
        "Qwen2ForCausalLM is served in the graph for LlamaForCausalLM, MistralForCausalLM, "
        "Gemma3ForCausalLM only" in " ".join(plan.describe().split())
    )


def test_explicit_paths_are_kept(tiny_dense: Path, tiny_theta_g1: Path) -> None:
    stock = ServingOptions(path="precompute-outside")
    assert plan_serving(tiny_theta_g1, stock).path == "precompute-outside"
    assert plan_serving(tiny_theta_g1, ServingOptions(path="gemm")).path == "gemm"
    assert plan_serving(tiny_dense, ServingOptions(path="gemm")).path == "gemm"
    assert "chosen by --path precompute-outside" in plan_serving(tiny_theta_g1, stock).describe()
