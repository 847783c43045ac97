"""The sensitivity allocation: each projection's output error weighed by the KL it costs."""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnquant_core import DecomposeSpec, ThetaCheckpoint, decompose_budget
from attnquant_core._errors import DecompositionError
from attnquant_core.calib import (
    CalibrationError,
    ModelSource,
    Sensitivity,
    decompose_calibrated,
    evaluate,
    measure_sensitivity,
    open_source,
    read_sensitivity,
    read_stats,
    sensitivity_path,
    whitened_svd,
)
from attnquant_core.calib._sensitivity import probe_rank
from attnquant_core.fit import DEFAULT_ALLOCATION, resolve_allocation
from attnquant_core.fit._whitened import Calibration, as_calibration

#: The windows tiny_calibrated's statistics were made of (conftest).
WINDOWS = np.random.default_rng(0).integers(0, 16, size=(8, 16))


@pytest.fixture(scope="module")
def sensitized(tiny_calibrated, tmp_path_factory):
    """tiny_calibrated's statistics, copied, with their sensitivities measured beside them."""
    directory, stats_file, state = tiny_calibrated
    tmp = tmp_path_factory.mktemp("sensitized")
    stats = Path(shutil.copy(stats_file, tmp / "stats.safetensors"))
    sens = measure_sensitivity(
        open_source(directory), WINDOWS, Calibration(stats=read_stats(stats))
    )
    sens.write(sensitivity_path(stats))
    return directory, stats, state, sens


def _keys(state: dict) -> list[str]:
    return sorted(k for k in state if ".layers." in k and k.endswith("_proj.weight"))


def test_alpha_is_the_probe_kl_over_its_output_error(sensitized) -> None:
    directory, stats_file, state, sens = sensitized
    stats = read_stats(stats_file)
    cal = Calibration(stats=stats)
    assert set(sens.weights) == set(_keys(state)) == set(sens.kl) == set(sens.error2)
    assert all(math.isfinite(a) and a > 0 for a in sens.weights.values())
    assert sens.tokens == WINDOWS.size and sens.stats_digest == stats.digest
    source = open_source(directory)
    for key in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        W = state[key].astype(np.float64)
        U, V, sigma = whitened_svd(W, cal.whitening(key, W.shape[1]), probe_rank(W.shape, 0.5))
        assert sens.error2[key] == pytest.approx(np.sum(sigma[U.shape[1] :] ** 2) / stats.tokens)
        probed = dict(state)
        probed[key] = (U @ V.T).astype(np.float32)
        other = ModelSource(
            path=Path("probed"), config=source.config, keys=frozenset(probed), get=probed.get
        )
        kl = evaluate([source, other], WINDOWS)[1].kl
        assert sens.kl[key] == pytest.approx(kl, rel=1e-4)
        assert sens.weights[key] == pytest.approx(sens.kl[key] / sens.error2[key])


def test_sensitivity_file_round_trip_and_refusals(sensitized, tmp_path) -> None:
    _, stats_file, _, sens = sensitized
    path = sensitivity_path(stats_file)
    assert path.name == "stats.safetensors.sensitivity.json"
    again = read_sensitivity(path, stats_digest=read_stats(stats_file).digest)
    assert again == sens
    with pytest.raises(CalibrationError, match="not these"):
        read_sensitivity(path, stats_digest="sha256:" + "0" * 64)
    with pytest.raises(CalibrationError, match="calibrate CKPT -o STATS --sensitivity"):
        read_sensitivity(tmp_path / "none.json")
    bad = tmp_path / "bad.json"
    raw = json.loads(path.read_text())
    bad.write_text(json.dumps({**raw, "weights": {"k": -1.0}}))
    with pytest.raises(CalibrationError, match="finite numbers >= 0"):
        read_sensitivity(bad)
    bad.write_text("{}")
    with pytest.raises(CalibrationError, match="not a sensitivity file"):
        read_sensitivity(bad)


def test_a_failed_write_leaves_the_file_as_it_was(sensitized, tmp_path, monkeypatch) -> None:
    """Sensitivity.write goes through write_atomic: a write that fails midway (a full disk)
    leaves the earlier file whole and no temporary file beside it."""
    *_, sens = sensitized
    path = sens.write(tmp_path / "s.json")
    before = path.read_bytes()

    def half(self, text, *args, **kwargs):
        Path.write_bytes(self, text[: len(text) // 2].encode())
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", half)
    with pytest.raises(OSError, match="No space left"):
        sens.write(path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.json"]


@pytest.mark.parametrize("forms", [("lowrank",), None])
@pytest.mark.parametrize("budget", [0.3, 0.5, 0.8])
def test_budget_is_respected(sensitized, tmp_path, budget, forms) -> None:
    directory, stats_file, _, sens = sensitized
    report = decompose_budget(
        directory,
        tmp_path / "out",
        budget=budget,
        calibration=stats_file,
        allocation="sensitivity",
        **({} if forms is None else {"forms": forms}),
    )
    assert report.stored <= math.floor(budget * report.dense)
    manifest = json.loads((tmp_path / "out" / "attnquant.json").read_text())
    assert manifest["budget"]["allocation"] == "sensitivity"
    record = manifest["calibration"]["sensitivity"]
    assert record["probe"] == sens.probe and record["tokens"] == sens.tokens
    assert record["path"] == str(sensitivity_path(stats_file))
    glob = decompose_budget(
        directory, tmp_path / "g", budget=budget, calibration=stats_file, allocation="global"
    )
    assert glob.manifest["budget"]["allocation"] == "global"
    assert "sensitivity" not in glob.manifest["calibration"]


def test_unset_allocation_uses_sensitivities_where_they_were_measured(sensitized, tmp_path):
    """The default: the measured sensitivities beside the statistics, else the global split."""
    directory, stats_file, _, _ = sensitized
    given = decompose_budget(
        directory, tmp_path / "s", budget=0.4, calibration=stats_file, allocation="sensitivity"
    )
    unset = decompose_budget(directory, tmp_path / "u", budget=0.4, calibration=stats_file)
    assert unset.manifest["budget"]["allocation"] == "sensitivity"
    assert (
        unset.manifest["calibration"]["sensitivity"] == given.manifest["calibration"]["sensitivity"]
    )
    for name, choice in unset.families.items():
        assert list(choice.ranks) == list(given.families[name].ranks), name
    lone = tmp_path / "lone.safetensors"
    shutil.copy(stats_file, lone)  # statistics without sensitivities beside them
    plain = decompose_budget(directory, tmp_path / "p", budget=0.4, calibration=lone)
    assert plain.manifest["budget"]["allocation"] == "global"
    assert resolve_allocation(None, None) == DEFAULT_ALLOCATION == "global"
    assert resolve_allocation("global", as_calibration(stats_file)) == "global"
    assert resolve_allocation(None, as_calibration(stats_file)) == "sensitivity"


def _lowrank(directory, out, budget, cal) -> dict[str, list[int]]:
    report = decompose_budget(
        directory, out, budget=budget, forms=["lowrank"], calibration=cal, allocation="sensitivity"
    )
    return {name: list(c.ranks) for name, c in report.families.items()}


def test_ranks_grow_with_the_budget(sensitized, tmp_path) -> None:
    directory, stats_file, _, _ = sensitized
    previous = None
    for i, budget in enumerate((0.1, 0.2, 0.35, 0.5, 0.7, 0.9, 1.0)):
        ranks = _lowrank(directory, tmp_path / f"b{i}", budget, stats_file)
        if previous is not None:
            for name, r in ranks.items():
                assert all(a >= b for a, b in zip(r, previous[name], strict=True)), name
        previous = ranks


def test_the_allocation_minimises_the_weighted_output_error(sensitized, tmp_path) -> None:
    """Low rank: the predicted error is sum_k alpha_k ||(W_k - W_hat_k) S_k||^2, and the greedy
    is by alpha_k sigma_kj^2 per parameter; a common factor on every weight changes nothing."""
    directory, stats_file, state, sens = sensitized
    stats = read_stats(stats_file)
    cal = Calibration(stats=stats, error_weights=sens.weights)
    report = decompose_budget(
        directory, tmp_path / "a", budget=0.4, forms=["lowrank"], calibration=cal,
        allocation="sensitivity",
    )  # fmt: skip
    tails, units, got = 0.0, [], {}
    for key in _keys(state):
        W = state[key].astype(np.float64)
        sigma = whitened_svd(W, cal.whitening(key, W.shape[1]), 0)[2]
        layer, name = int(key.split(".")[2]), key.split(".", 3)[3][: -len(".weight")]
        got[key] = r = report.families[name].ranks[layer]
        tails += sens.weights[key] * float(np.sum(sigma[r:] ** 2))
        units += [(sens.weights[key] * x**2 / sum(W.shape), sum(W.shape), key) for x in sigma]
    assert report.error2 == pytest.approx(tails, rel=1e-9)
    # The greedy, by weighted drop per parameter, skipping units that no longer fit.
    left, want = math.floor(0.4 * report.dense), dict.fromkeys(got, 0)
    for _, cost, key in sorted(units, key=lambda u: -u[0]):
        if cost <= left:
            want[key] += 1
            left -= cost
    assert got == want
    scaled = Calibration(stats=stats, error_weights={k: 1e3 * a for k, a in sens.weights.items()})
    assert _lowrank(directory, tmp_path / "s", 0.4, scaled) == {
        n: list(c.ranks) for n, c in report.families.items()
    }


def test_a_larger_weight_buys_rank(sensitized, tmp_path) -> None:
    directory, stats_file, _, sens = sensitized
    stats = read_stats(stats_file)
    key = "model.layers.1.self_attn.o_proj.weight"
    base = _lowrank(
        directory, tmp_path / "b", 0.4, Calibration(stats=stats, error_weights=sens.weights)
    )
    heavier = dict(sens.weights, **{key: 100 * sens.weights[key]})
    more = _lowrank(directory, tmp_path / "m", 0.4, Calibration(stats=stats, error_weights=heavier))
    assert more["self_attn.o_proj"][1] > base["self_attn.o_proj"][1]
    lighter = dict(sens.weights, **{key: 0.0})
    none = _lowrank(directory, tmp_path / "n", 0.4, Calibration(stats=stats, error_weights=lighter))
    assert none["self_attn.o_proj"][1] == 0


@settings(max_examples=12, deadline=None)
@given(
    budget=st.floats(0.05, 1.0),
    logs=st.lists(st.floats(-6.0, 6.0), min_size=14, max_size=14),
    forms=st.sampled_from([("lowrank",), ("lowrank", "shared_basis", "banded")]),
)
def test_any_weights_any_budget(tiny_calibrated, budget, logs, forms) -> None:
    directory, stats_file, state = tiny_calibrated
    weights = {k: 10.0**x for k, x in zip(_keys(state), logs, strict=True)}
    cal = Calibration(stats=read_stats(stats_file), error_weights=weights)
    with tempfile.TemporaryDirectory() as tmp:
        report = decompose_budget(  # low rank is always among the forms: every budget fits
            directory, Path(tmp) / "o", budget=budget, forms=forms, calibration=cal,
            allocation="sensitivity",
        )  # fmt: skip
        assert report.stored <= math.floor(budget * report.dense)
        theta = ThetaCheckpoint.open(Path(tmp) / "o")
        for key in ("model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.k_proj.weight"):
            layer, name = int(key.split(".")[2]), key.split(".", 3)[3][: -len(".weight")]
            rebuilt = theta.rebuild(name, layer)
            assert rebuilt.shape == state[key].shape and np.isfinite(rebuilt).all()


def test_allocation_options_are_checked(tiny_calibrated, tmp_path) -> None:
    directory, stats_file, _ = tiny_calibrated
    assert DecomposeSpec(budget=0.5).effective_allocation == "global"
    with pytest.raises(DecompositionError, match="choose one of global, sensitivity"):
        DecomposeSpec(budget=0.5, allocation="kl")
    with pytest.raises(DecompositionError, match="--allocation splits a budget"):
        DecomposeSpec(rank=4, allocation="sensitivity", spelling="cli")
    with pytest.raises(DecompositionError, match="--calibration STATS"):
        DecomposeSpec(budget="0.5", allocation="sensitivity", spelling="cli")
    with pytest.raises(DecompositionError, match="pass calibration="):
        decompose_budget(directory, tmp_path / "o", budget=0.5, allocation="sensitivity")
    lone = tmp_path / "lone.safetensors"
    shutil.copy(stats_file, lone)  # statistics without sensitivities beside them
    with pytest.raises(CalibrationError, match="--sensitivity"):
        decompose_budget(
            directory, tmp_path / "o", budget=0.5, calibration=lone, allocation="sensitivity"
        )
    assert not (tmp_path / "o").exists()
    partial = Calibration(stats=read_stats(lone), error_weights={"model.layers.0.x": 1.0})
    with pytest.raises(CalibrationError, match="no sensitivity for"):
        decompose_budget(
            directory, tmp_path / "o", budget=0.5, calibration=partial, allocation="sensitivity"
        )


@pytest.mark.parametrize("sequential", [False, True])
def test_decompose_calibrated_measures_them_in_the_pass(sensitized, tmp_path, sequential) -> None:
    directory, stats_file, _, sens = sensitized
    manifest = decompose_calibrated(
        open_source(directory), WINDOWS, tmp_path / "o", budget=0.5, sequential=sequential,
        allocation="sensitivity",
    )  # fmt: skip
    assert manifest["budget"]["allocation"] == "sensitivity"
    assert manifest["budget"]["stored_over_dense"] <= 0.5
    record = manifest["calibration"]["sensitivity"]
    assert record["windows_digest"] == sens.windows_digest and record["tokens"] == sens.tokens
    # The same windows and statistics: the same ranks as decompose_budget from the file.
    from_file = decompose_budget(
        directory, tmp_path / "f", budget=0.5, calibration=stats_file, allocation="sensitivity"
    )
    for name, fam in manifest["families"].items():
        assert fam["ranks"] == list(from_file.families[name].ranks), name


def test_a_sensitivity_record_round_trips_through_json() -> None:
    s = Sensitivity(weights={"a": 1.5}, kl={"a": 0.1}, error2={"a": 0.2}, tokens=4)
    assert s.to_json()["weights"] == {"a": 1.5}
    assert s.record() == {"probe": 0.5, "tokens": 4, "windows_digest": None}
