"""A checkpoint fitted to a budget is served compressed by default: no option, no variable.

``decompose --budget 0.5`` mixes forms per family (banded, low rank, shared bases). ``--path
auto`` serves such a checkpoint in the graph holding only its own bytes, on the formulation
measured faster on the device (on the CPU the custom op: ``generated_linear`` per banded
projection, ``generated_lowrank`` per low-rank or shared-basis one). ``attnquant verify X X``
on the tiny Llama's fit compares it with the same checkpoint rebuilt at load; its graph is the
one ``packages/attnquant-max/tests/test_ingraph.py`` compiles for that fit (the cache hits in a
full run). The demo's fit is checked by its plan and the tensors it would hold, without a graph
(the demo's compile, 450 s on 2 cores, was measured by hand: 0.625x, docs/serving-paths.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attnquant_cli import cli
from attnquant_core import ThetaCheckpoint, decompose_budget, decompose_checkpoint, open_checkpoint
from attnquant_core.serving import LEGACY_PATH_VARIABLES, OPTIONS
from attnquant_max import PATH_DESCRIPTIONS, ServingOptions, plan_serving
from attnquant_max.testing import MAX_BATCH_SIZE, MAX_LENGTH, write_tiny_llama

SIZES = ["--max-length", str(MAX_LENGTH), "--max-batch-size", str(MAX_BATCH_SIZE)]


def _dense_bytes(path: Path) -> int:
    ckpt = open_checkpoint(path)
    return sum(ckpt.get(key).nbytes for key in ckpt.keys())


@pytest.fixture(scope="module")
def tiny_budget(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama fitted to half its size, as attnquant-max's tests fit it."""
    dense = write_tiny_llama(tmp_path_factory.mktemp("tiny") / "dense")
    out = tmp_path_factory.mktemp("tiny") / "budget"
    decompose_checkpoint(dense, out, budget=0.5)
    return out


@pytest.mark.slow
@pytest.mark.xdist_group("tiny")
def test_budget_checkpoint_is_served_compressed_by_default(
    tiny_budget: Path, tmp_path: Path, capsys, monkeypatch, caplog
) -> None:
    for variable in [*LEGACY_PATH_VARIABLES, *(spec.variable for spec in OPTIONS)]:
        monkeypatch.delenv(variable, raising=False)  # no variable set: the defaults
    plan = plan_serving(tiny_budget, ServingOptions())
    assert plan.in_graph
    report_path = tmp_path / "verify.json"
    argv = ["verify", str(tiny_budget), str(tiny_budget), "-o", str(report_path), *SIZES]
    with caplog.at_level("INFO"):
        code = cli([*argv, "--max-new-tokens", "8"])
    report, text = json.loads(report_path.read_text()), capsys.readouterr().out
    assert code == 0, text
    assert f"on the {PATH_DESCRIPTIONS[plan.path]}" in caplog.text  # the theta side
    assert "--path auto: a compressed theta checkpoint is served in the graph" in caplog.text
    # The same numpy identity on both sides: float32 reassociation only.
    assert report["agreement"] == 1.0
    assert report["max_abs_logprob_delta"] < 1e-3
    # Held: the checkpoint's own tensors, at most 0.70x the rebuilt dense model's (the base).
    held = sum(array.nbytes for _, array in plan.theta_state())
    assert report["theta_weight_bytes"] == held
    assert report["theta_weight_bytes"] <= 0.70 * report["base_weight_bytes"]


@pytest.fixture(scope="module")
def demo_budget(demo: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo at budget 0.5. The search is narrowed to the forms the full search
    (``decompose demo --budget 0.5``) picks on the demo, low rank and a shared basis at
    ``G = 3``, which gives the same forms and ranks in about two thirds of the time."""
    out = tmp_path_factory.mktemp("theta") / "demo-budget-0.5"
    decompose_budget(demo, out, budget=0.5, forms=("lowrank", "shared_basis"), shared_blocks=(3,))
    forms = set(ThetaCheckpoint.open(out).forms.values())
    assert forms == {"lowrank", "shared_basis"}, forms
    return out


def test_the_demos_budget_fit_is_planned_compressed_by_default(
    demo: Path, demo_budget: Path
) -> None:
    """No option, no variable: ``--path auto`` plans the demo's budget-0.5 fit in the graph,
    holding at most 0.70x the dense weight bytes, and says why; the demo itself stays on the
    stock graph. No graph is built: the plan and the tensors it hands MAX."""
    dense_bytes = _dense_bytes(demo)
    assert plan_serving(demo, ServingOptions()).path == "precompute-outside"
    plan = plan_serving(demo_budget, ServingOptions.from_env({}))
    assert plan.in_graph and plan.path in ("custom-op", "gemm")
    assert "--path auto: a compressed theta checkpoint is served in the graph" in plan.describe()
    held = sum(array.nbytes for _, array in plan.theta_state())
    assert held <= 0.70 * dense_bytes, (held, dense_bytes)
