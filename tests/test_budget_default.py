"""A checkpoint fitted to a budget is served compressed by default: `attnquant verify` with no
option and no variable.

``decompose demo --budget 0.5`` mixes forms per family (low rank, shared bases). ``--path auto``
serves such a checkpoint in the graph holding only its own bytes, on the formulation measured
faster on the device (on the CPU the custom op, one ``generated_lowrank`` per projection);
``verify X X`` compares it with the same checkpoint rebuilt at load (the stock graph,
``demo_graph``). One more graph: the demo's in-graph decoder for these forms. Each form is
checked against the numpy identity at the layer level in
``packages/attnquant-max/tests/test_layers.py``, and on the GEMM path for the tiny Llama in
``packages/attnquant-max/tests/test_ingraph.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attnquant_cli import cli
from attnquant_core import ThetaCheckpoint, decompose_budget
from attnquant_core.serving import LEGACY_PATH_VARIABLES, OPTIONS
from attnquant_max import PATH_DESCRIPTIONS, ServingOptions, plan_serving

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("demo_graph")]


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


@pytest.mark.xdist_group("demo-budget")
def test_budget_checkpoint_is_served_compressed_by_default(
    demo_budget: Path, tmp_path: Path, capsys, monkeypatch, caplog
) -> None:
    for variable in [*LEGACY_PATH_VARIABLES, *(spec.variable for spec in OPTIONS)]:
        monkeypatch.delenv(variable, raising=False)  # no variable set: the defaults
    plan = plan_serving(demo_budget, ServingOptions())
    report_path = tmp_path / "verify.json"
    with caplog.at_level("INFO"):
        code = cli(["verify", str(demo_budget), str(demo_budget), "-o", str(report_path)])
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
    print(
        f"demo budget 0.5 by default ({plan.path}): max |dlogprob| "
        f"{report['max_abs_logprob_delta']:.2e}, weights held {report['theta_weight_bytes']} of "
        f"{report['base_weight_bytes']} B ({report['theta_weight_bytes'] / report['base_weight_bytes']:.3f}x)"
    )


@pytest.mark.xdist_group("demo-budget")  # the fit is made once, on this group's worker
def test_a_budget_fit_is_served_compressed_by_default(demo: Path, demo_budget: Path) -> None:
    """No option, no variable: ``--path auto`` serves the budget-0.5 fit in the graph holding
    its own bytes (at most 0.70x the dense weights), and says why in its start-up line; the
    demo itself stays on the stock graph. No graph is built: the plan and its tensors only."""
    from attnquant_core import open_checkpoint

    dense = open_checkpoint(demo)
    dense_bytes = sum(dense.get(key).nbytes for key in dense.keys())
    assert plan_serving(demo, ServingOptions()).path == "precompute-outside"
    plan = plan_serving(demo_budget, ServingOptions.from_env({}))
    assert plan.in_graph and plan.path in ("custom-op", "gemm")
    line = plan.describe()
    assert "--path auto: a compressed theta checkpoint is served in the graph" in line
    held = sum(array.nbytes for _, array in plan.theta_state())
    assert held <= 0.70 * dense_bytes, (held, dense_bytes)
    print(
        f"demo budget 0.5 by default: {plan.path}, {held} of {dense_bytes} B ({held / dense_bytes:.3f}x)"
    )
