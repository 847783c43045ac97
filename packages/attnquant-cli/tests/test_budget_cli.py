"""``attnquant decompose --budget`` and ``attnquant analyze --budget``."""

from __future__ import annotations

import csv
import json

import pytest

from attnquant_cli import cli
from attnquant_core import ThetaCheckpoint
from attnquant_core.testing import make_structured_weights, write_checkpoint


@pytest.fixture
def src(tmp_path):
    return write_checkpoint(tmp_path / "src", make_structured_weights(4, kind="shared"))


def test_decompose_at_a_budget_says_what_was_chosen_and_why(src, tmp_path, capsys):
    out = tmp_path / "theta"
    assert cli(["decompose", str(src), "-o", str(out), "--budget", "0.5"]) == 0
    table = capsys.readouterr().out
    assert "budget 0.5, auto form" in table
    for word in ("form", "bands", "ranks", "stored / dense", "why", "total", "per-layer SVD"):
        assert word in table
    assert "banded" in table and "gives the least total error" in table
    ckpt = ThetaCheckpoint.open(out)
    manifest = ckpt.manifest
    assert manifest["budget"]["budget"] == 0.5
    assert manifest["budget"]["stored_parameters"] <= 0.5 * manifest["budget"]["dense_parameters"]
    assert all("why" in f for f in manifest["families"].values())
    assert len(dict(ckpt.rebuilt_state())) == len(ckpt.stock_keys())


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0", "--budget 0: must be in (0, 1]"),
        ("-0.2", "--budget -0.2: must be in (0, 1]"),
        ("1.5", "--budget 1.5: must be in (0, 1]"),
        ("nan", "--budget nan: must be in (0, 1]"),
        ("half", "--budget 'half' is not a number"),
    ],
)
def test_bad_budgets_get_one_line_naming_the_option(src, tmp_path, capsys, value, message):
    assert cli(["decompose", str(src), "-o", str(tmp_path / "t"), "--budget", value]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize("extra", [["--rank", "4"], ["--blocks", "2"]])
def test_budget_excludes_blocks_and_rank(src, tmp_path, capsys, extra):
    argv = ["decompose", str(src), "-o", str(tmp_path / "t"), "--budget", "0.5", *extra]
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert "give either --budget or --blocks/--rank" in err
    assert not (tmp_path / "t").exists()


def test_decompose_without_budget_is_unchanged(src, tmp_path, capsys):
    assert cli(["decompose", str(src), "-o", str(tmp_path / "t"), "--rank", "2"]) == 0
    assert "(G=1, r=2)" in " ".join(capsys.readouterr().out.split())  # the title may wrap
    ckpt = ThetaCheckpoint.open(tmp_path / "t")
    assert ckpt.blocks == 1 and ckpt.rank == 2


def test_analyze_adds_the_budget_frontier(src, tmp_path, capsys):
    out = tmp_path / "an"
    argv = ["analyze", str(src), "--blocks", "1", "--rank", "0,4", "--budget", "0.2,0.5", "-o"]
    assert cli([*argv, str(out)]) == 0
    table = capsys.readouterr().out
    assert "budget frontier (auto form)" in table and "auto error" in table
    rows = list(csv.DictReader((out / "analyze.csv").read_text().splitlines()))
    auto = [r for r in rows if r["family"] == "auto"]
    assert [float(r["budget"]) for r in auto] == [0.2, 0.5]
    for r in auto:
        assert float(r["error"]) <= float(r["svd_error"]) + 1e-12
        assert int(r["stored_parameters"]) <= float(r["budget"]) * int(r["dense_parameters"])
        assert "q_proj=" in r["forms"]
    assert all(r["budget"] == "" for r in rows if r["family"] != "auto")
    data = json.loads((out / "analyze.json").read_text())
    frontier = data["budget_frontier"]
    assert [p["budget"] for p in frontier] == [0.2, 0.5]
    assert {"error", "lowrank_global_error", "forms", "compression"} <= set(frontier[0])
    assert (out / "analyze.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_analyze_refuses_bad_budgets(src, tmp_path, capsys):
    assert cli(["analyze", str(src), "--budget", "0.5,2", "-o", str(tmp_path / "a")]) == 2
    assert "--budget 2: must be in (0, 1]" in capsys.readouterr().err


def test_demo_model_auto_form_is_never_above_per_layer_svd():
    """The demo model (trained weights): at every budget the auto form's total error is at most
    per-layer SVD with globally allocated ranks (fewer candidate G keep this test quick)."""
    from attnquant_cli._demo import demo_model_path
    from attnquant_core import budget_frontier

    points = budget_frontier(
        demo_model_path(), [0.2, 0.3, 0.5, 0.7], banded_blocks=[1], shared_blocks=[1, 3]
    )
    for p in points:
        assert p.stored <= p.budget * p.dense and p.baseline_stored <= p.budget * p.dense
        assert p.error <= p.baseline_error + 1e-12, p
    assert points[-1].error < points[-1].baseline_error  # shared bases help at 0.7
