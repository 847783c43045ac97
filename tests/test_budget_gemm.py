"""A checkpoint fitted to a budget, served compressed: `attnquant verify` on the GEMM path.

``decompose demo --budget 0.5`` mixes forms per family (low rank, shared bases, banded). On the
GEMM path every form runs in the graph holding only the checkpoint's bytes (dense weights only
for layers whose factors are not smaller); ``verify X X`` compares it with the same checkpoint
rebuilt at load (precompute-outside, the stock graph ``demo_graph`` compiled). One more graph:
the demo's GEMM decoder for these forms. Each form is checked against the numpy identity at the
layer level in ``packages/attnquant-max/tests/test_layers.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attnquant_cli import cli
from attnquant_core import ThetaCheckpoint, decompose_budget
from attnquant_max import PATH_DESCRIPTIONS
from attnquant_max.testing import gemm_weight_bytes

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("demo_graph")]

GEMM = {"ATTNQUANT_PRECOMPUTE_OUTSIDE": "0", "ATTNQUANT_GEMM": "1"}


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


@pytest.mark.xdist_group("demo-verify")
def test_budget_checkpoint_verifies_on_the_gemm_path(
    demo_budget: Path, tmp_path: Path, capsys, monkeypatch, caplog
) -> None:
    for name, value in GEMM.items():
        monkeypatch.setenv(name, value)
    report_path = tmp_path / "verify.json"
    with caplog.at_level("INFO"):
        code = cli(["verify", str(demo_budget), str(demo_budget), "-o", str(report_path)])
    report, text = json.loads(report_path.read_text()), capsys.readouterr().out
    assert code == 0, text
    assert f"on the {PATH_DESCRIPTIONS['gemm']}" in caplog.text  # the theta side
    # The same numpy identity on both sides: float32 reassociation only.
    assert report["agreement"] == 1.0
    assert report["max_abs_logprob_delta"] < 1e-3
    # Held: the checkpoint's bytes, not the rebuilt dense model's (the base side).
    assert report["theta_weight_bytes"] == gemm_weight_bytes(demo_budget)
    assert report["theta_weight_bytes"] < report["base_weight_bytes"]
    print(
        f"demo budget 0.5, GEMM path: max |dlogprob| {report['max_abs_logprob_delta']:.2e}, "
        f"weights held {report['theta_weight_bytes']} of {report['base_weight_bytes']} B"
    )
