"""The global budget: forms and ranks chosen for the least total error at a stored size."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attnquant_core as aq
import attnquant_core.fit._spectra as budget_module
from attnquant_core import (
    DecompositionError,
    ThetaCheckpoint,
    budget_frontier,
    decompose_checkpoint,
    fit_budget,
    open_checkpoint,
)
from attnquant_core.testing import family_weights, make_structured_weights, write_checkpoint

BUDGETS = (0.2, 0.3, 0.5, 0.7)


@pytest.fixture(scope="module")
def models():
    return {
        kind: family_weights(make_structured_weights(8, kind=kind, seed=1))
        for kind in ("shared", "subspace", "independent")
    }


def _measured(model, families) -> float:
    """Relative Frobenius error of the fitted model over every weight, in float64."""
    num = den = 0.0
    for name, weights in families.items():
        fam = model.families[name]
        for layer, W in enumerate(weights):
            W = W.astype(np.float64)
            num += float(np.sum((W - fam.reconstruct(layer).astype(np.float64)) ** 2))
            den += float(np.sum(W**2))
    return math.sqrt(num / den)


def _check(model, report, families, budget):
    assert report.stored == model.stored_parameters() <= math.floor(budget * report.dense)
    assert report.dense == model.dense_parameters()
    assert report.error <= report.baseline_error + 1e-12
    assert report.baseline_stored <= math.floor(budget * report.dense)
    measured = _measured(model, families)
    assert measured == pytest.approx(report.error, rel=1e-4, abs=1e-6)
    assert report.measured_error == pytest.approx(measured, rel=1e-4, abs=1e-6)
    for name, choice in report.families.items():
        fam = model.families[name]
        assert fam.form == choice.form and fam.ranks == choice.ranks
        assert fam.stored_parameters() == choice.stored
        assert choice.why


@pytest.mark.parametrize("budget", BUDGETS)
def test_shared_layers_pick_shared_forms(models, budget):
    families = models["shared"]
    model, report = fit_budget(families, budget)
    _check(model, report, families, budget)
    assert all(c.form != "lowrank" for c in report.families.values())
    if budget <= 0.5:
        assert {c.form for c in report.families.values()} == {"banded"}
    assert report.error < 0.5 * report.baseline_error
    assert not report.used_baseline


@pytest.mark.parametrize("budget", BUDGETS)
def test_a_shared_input_subspace_picks_a_shared_input_basis(models, budget):
    families = models["subspace"]
    model, report = fit_budget(families, budget)
    _check(model, report, families, budget)
    assert {(c.form, c.side) for c in report.families.values()} <= {
        ("shared_basis", "in"),
        ("shared_basis", "out"),
    }
    assert sum(c.side == "in" for c in report.families.values()) >= 5


@pytest.mark.parametrize("budget", BUDGETS)
def test_independent_layers_pick_low_rank(models, budget):
    families = models["independent"]
    model, report = fit_budget(families, budget)
    _check(model, report, families, budget)
    for name, c in report.families.items():
        if min(len(families[name][0]), families[name][0].shape[1]) >= 24 or budget <= 0.3:
            assert c.form == "lowrank", (name, c.label)
    assert report.error == pytest.approx(report.baseline_error, rel=0.02)


def test_lowrank_errors_follow_from_singular_values(models):
    families = models["independent"]
    _, report = fit_budget(families, 0.3, forms=("lowrank",))
    for name, choice in report.families.items():
        tail = 0.0
        for W, r in zip(families[name], choice.ranks, strict=True):
            S = np.linalg.svd(W.astype(np.float64), compute_uv=False)
            tail += float(np.sum(S[r:] ** 2))
        assert choice.error2 == pytest.approx(tail, rel=1e-9, abs=1e-9)
        assert choice.stored == sum(choice.ranks) * sum(families[name][0].shape)
    # the low-rank-only allocation is the baseline itself
    assert report.error == pytest.approx(report.baseline_error, rel=1e-12)
    assert report.used_baseline


def test_the_baseline_is_greedy_by_error_drop_per_parameter(models):
    families = models["independent"]
    budget = 0.3
    _, report = fit_budget(families, budget, forms=("lowrank",))
    units = []  # (drop per parameter, drop, cost)
    for weights in families.values():
        cost = sum(weights[0].shape)
        for W in weights:
            S = np.linalg.svd(W.astype(np.float64), compute_uv=False)
            units += [(s * s / cost, s * s, cost) for s in S]
    units.sort(key=lambda u: -u[0])
    left = math.floor(budget * report.dense)
    gained = 0.0
    for _, drop, cost in units:
        if cost <= left:
            left -= cost
            gained += drop
    total = sum(float(np.sum(W.astype(np.float64) ** 2)) for ws in families.values() for W in ws)
    assert report.baseline_error == pytest.approx(math.sqrt((total - gained) / total), rel=1e-9)


@st.composite
def small_models(draw):
    L = draw(st.integers(1, 5))
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    families = {}
    for f in range(draw(st.integers(1, 3))):
        out_dim, in_dim = draw(st.integers(1, 12)), draw(st.integers(1, 12))
        base = rng.standard_normal((out_dim, in_dim))
        mix = draw(st.floats(0.0, 1.0))
        families[f"f{f}"] = [
            (mix * base + rng.standard_normal((out_dim, in_dim))).astype(dtype) for _ in range(L)
        ]
    return families, draw(st.floats(0.02, 1.0)), dtype


@settings(max_examples=20, deadline=None)
@given(small_models())
def test_budget_respected_and_never_worse_than_the_baseline(case):
    families, budget, dtype = case
    dense = sum(len(ws) * ws[0].size for ws in families.values())
    model, report = fit_budget(families, budget)  # low rank at rank 0 always fits
    assert report.stored <= math.floor(budget * dense)
    assert report.error <= report.baseline_error + 1e-12
    tol = 1e-9 if dtype == np.float64 else 2e-4
    assert _measured(model, families) == pytest.approx(report.error, rel=tol, abs=tol)


def test_randomized_spectra_above_the_exact_size(models, monkeypatch):
    """Above BUDGET_EXACT_MAX_DIM the spectra are sketched, capped, and still exact about
    what they predict: the fitted factors are cut from the same sketches."""
    monkeypatch.setattr(budget_module, "BUDGET_EXACT_MAX_DIM", 6)
    for kind in ("shared", "subspace", "independent"):
        families = models[kind]
        for budget in (0.2, 0.5):
            model, report = fit_budget(families, budget)
            _check(model, report, families, budget)
            for name, c in report.families.items():
                out_dim, in_dim = families[name][0].shape
                if c.form in ("lowrank", "banded"):
                    cap = math.ceil(min(1.0, 2 * budget) * out_dim * in_dim / (out_dim + in_dim))
                    assert max(c.ranks) <= min(cap, out_dim, in_dim)


def test_forms_can_be_restricted(models):
    families = models["shared"]
    _, report = fit_budget(families, 0.5, forms=("shared_basis",), shared_blocks=[1])
    assert {c.label for c in report.families.values()} <= {
        "shared_basis(in, G=1)",
        "shared_basis(out, G=1)",
    }
    _, banded = fit_budget(families, 0.5, forms=("banded",), banded_blocks=[2])
    assert {c.label for c in banded.families.values()} == {"banded(G=2)"}
    with pytest.raises(DecompositionError, match="need at least"):
        fit_budget(families, 0.05, forms=("banded",))


@pytest.mark.parametrize("bad", [0, -0.5, 1.5, float("nan"), float("inf"), True, "0.5", None])
def test_bad_budgets_are_refused(models, bad):
    with pytest.raises(DecompositionError, match="budget"):
        fit_budget(models["shared"], bad)  # type: ignore[arg-type]


def test_bad_arguments_are_refused(models):
    families = models["shared"]
    with pytest.raises(DecompositionError, match=r"forms \['dense'\]"):
        fit_budget(families, 0.5, forms=("dense",))
    with pytest.raises(DecompositionError, match="whole numbers >= 1"):
        fit_budget(families, 0.5, banded_blocks=[0])
    with pytest.raises(DecompositionError, match="same number of layers"):
        fit_budget({"a": families["mlp.up_proj"], "b": families["mlp.up_proj"][:3]}, 0.5)
    with pytest.raises(DecompositionError, match="shape mismatch inside the family: layer 1"):
        fit_budget({"a": [np.ones((3, 4)), np.ones((4, 3))]}, 0.5)
    with pytest.raises(DecompositionError, match="a: layer 0 holds NaN"):
        fit_budget({"a": [np.full((3, 4), np.nan)]}, 0.5)
    with pytest.raises(DecompositionError, match="at least one family"):
        fit_budget({}, 0.5)


# -- the checkpoint path -------------------------------------------------------------------------


@pytest.fixture
def structured_ckpt(tmp_path):
    return write_checkpoint(tmp_path / "src", make_structured_weights(6, kind="shared", seed=3))


def test_decompose_at_a_budget_writes_what_fit_budget_fits(structured_ckpt, tmp_path):
    events = []
    manifest = decompose_checkpoint(
        structured_ckpt, tmp_path / "theta", budget=0.3, progress=events.append
    )
    assert {e.stage for e in events} == {"spectra", "fit"}
    ckpt = ThetaCheckpoint.open(tmp_path / "theta")
    assert manifest == json.loads((tmp_path / "theta" / "attnquant.json").read_text())
    assert manifest["format_version"] == 2 and manifest["budget"]["budget"] == 0.3
    assert manifest["budget"]["stored_parameters"] <= 0.3 * manifest["budget"]["dense_parameters"]
    assert (
        manifest["budget"]["predicted_error"] <= manifest["budget"]["baseline"]["predicted_error"]
    )
    src = open_checkpoint(structured_ckpt)
    families = {n: [src.get(k) for k in info.keys] for n, info in src.families.items()}
    model, report = fit_budget(families, 0.3)
    back = ckpt.load()
    for name, fam in model.families.items():
        entry = manifest["families"][name]
        assert entry["form"] == fam.form and entry["ranks"] == list(fam.ranks) and entry["why"]
        assert entry["error"] == pytest.approx(report.families[name].measured_error, rel=1e-9)
        for a, b in zip(fam.arrays(), back.families[name].arrays(), strict=True):
            assert np.array_equal(a, b)
        for layer, W in enumerate(families[name]):
            W_eff = ckpt.rebuild(name, layer).astype(np.float64)
            err = np.linalg.norm(W - W_eff) / np.linalg.norm(W)
            assert err == pytest.approx(entry["errors"][layer], rel=1e-5, abs=1e-7)
    digests = manifest["source"]["digests"]
    assert len(digests) == len(src.keys())
    assert (tmp_path / "theta" / "tokenizer.json").exists()


def test_decompose_budget_refuses_explicit_blocks_or_rank(structured_ckpt, tmp_path):
    with pytest.raises(DecompositionError, match="either budget= or blocks=/rank="):
        decompose_checkpoint(structured_ckpt, tmp_path / "t", budget=0.5, rank=4)
    with pytest.raises(DecompositionError, match="either budget= or blocks=/rank="):
        decompose_checkpoint(structured_ckpt, tmp_path / "t", budget=0.5, blocks=1)
    with pytest.raises(DecompositionError, match=r"budget=1\.5 is outside \(0, 1\]"):
        decompose_checkpoint(structured_ckpt, tmp_path / "t", budget=1.5)
    assert not (tmp_path / "t").exists()


def test_interrupted_budget_write_leaves_nothing(structured_ckpt, tmp_path):
    def stop(event):
        if event.stage == "fit":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        decompose_checkpoint(structured_ckpt, tmp_path / "t", budget=0.5, progress=stop)
    assert os.listdir(tmp_path) == ["src"]


def test_frontier_matches_fit_budget(structured_ckpt):
    src = open_checkpoint(structured_ckpt)
    families = {n: [src.get(k) for k in info.keys] for n, info in src.families.items()}
    points = budget_frontier(src, BUDGETS)
    assert [p.budget for p in points] == list(BUDGETS)
    for p in points:
        _, report = fit_budget(families, p.budget)
        assert p.error == pytest.approx(report.error, rel=1e-12)
        assert p.baseline_error == pytest.approx(report.baseline_error, rel=1e-12)
        assert p.stored == report.stored and p.error <= p.baseline_error + 1e-12
        assert set(p.forms) == set(families)
        assert p.to_json()["lowrank_global_error"] == p.baseline_error
    errors = [p.error for p in points]
    assert errors == sorted(errors, reverse=True)  # more budget, less error
    with pytest.raises(DecompositionError, match="at least one budget"):
        budget_frontier(src, [])


def test_budget_report_json_says_what_was_chosen(models):
    _, report = fit_budget(models["subspace"], 0.3)
    data = report.to_json()
    assert data["budget"] == 0.3 and data["stored_parameters"] == report.stored
    fam = data["families"]["mlp.up_proj"]
    assert {"form", "side", "blocks", "ranks", "rank_min", "rank_max", "rank_mean", "why"} <= set(
        fam
    )
    assert data["baseline"]["what"] == "per-layer truncated SVD with globally allocated ranks"
    assert aq.check_budget(1) == 1.0
