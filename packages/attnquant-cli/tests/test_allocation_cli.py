"""attnquant calibrate --sensitivity and decompose --budget --allocation, on a tiny Llama with a
byte-level tokenizer (the demo's sensitivities take minutes on a busy 2-core machine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attnquant_cli import cli
from attnquant_core import MANIFEST_FILE
from attnquant_core.calib import read_sensitivity, read_stats, sensitivity_path

LAYERS = 2
FEW = ["--samples", "4", "--seq-len", "16"]


@pytest.fixture(scope="module")
def tiny(byte_llama) -> tuple[Path, str]:
    """A 2-layer byte-level Llama and a text (conftest's ``byte_llama``)."""
    return byte_llama(LAYERS)


def _manifest(path: Path) -> dict:
    return json.loads((path / MANIFEST_FILE).read_text())


def test_sensitivity_samples_bounds_the_probe(tmp_path: Path, capsys, tiny) -> None:
    model, data = tiny
    stats = tmp_path / "stats.safetensors"
    argv = ["calibrate", str(model), "-o", str(stats), "--data", data, *FEW, "--sensitivity"]
    assert cli([*argv, "--sensitivity-samples", "2"]) == 0, capsys.readouterr().err
    sens = read_sensitivity(sensitivity_path(stats), stats_digest=read_stats(stats).digest)
    assert read_stats(stats).tokens == 64 and sens.tokens == 32  # half the sequences probed


def test_calibrate_sensitivity_then_decompose_with_it(tmp_path: Path, capsys, tiny) -> None:
    model, data = tiny
    stats = tmp_path / "stats.safetensors"
    rc = cli(["calibrate", str(model), "-o", str(stats), "--data", data, *FEW, "--sensitivity"])
    assert rc == 0, capsys.readouterr().err
    assert "sensitivities in" in capsys.readouterr().err
    sens = read_sensitivity(sensitivity_path(stats), stats_digest=read_stats(stats).digest)
    assert len(sens.weights) == 7 * LAYERS and sens.tokens == 64
    out = tmp_path / "theta"
    argv = ["decompose", str(model), "-o", str(out), "--budget", "0.5", "--calibration", str(stats)]
    assert cli([*argv, "--allocation", "sensitivity"]) == 0
    assert "budget 0.5, auto form, sensitivity allocation" in capsys.readouterr().out
    manifest = _manifest(out)
    assert manifest["budget"]["allocation"] == "sensitivity"
    assert manifest["budget"]["stored_over_dense"] <= 0.5
    assert manifest["calibration"]["sensitivity"]["path"] == str(sensitivity_path(stats))
    # Unset, the sensitivities measured beside the statistics are used; --allocation global
    # leaves them aside.
    assert cli([*argv[:3], str(tmp_path / "d"), *argv[4:]]) == 0
    assert "sensitivity allocation" in " ".join(capsys.readouterr().out.split())
    assert _manifest(tmp_path / "d")["budget"]["allocation"] == "sensitivity"
    assert cli([*argv[:3], str(tmp_path / "g"), *argv[4:], "--allocation", "global"]) == 0
    assert _manifest(tmp_path / "g")["budget"]["allocation"] == "global"


@pytest.mark.parametrize("sequential", ["--sequential", "--no-sequential"])
def test_calibration_data_measures_them_in_the_pass(tmp_path: Path, tiny, sequential) -> None:
    model, data = tiny
    out = tmp_path / "theta"
    argv = ["decompose", str(model), "-o", str(out), "--budget", "0.5", "--calibration-data", data]
    assert cli([*argv, *FEW, sequential, "--allocation", "sensitivity"]) == 0
    manifest = _manifest(out)
    assert manifest["budget"]["allocation"] == "sensitivity"
    assert manifest["calibration"]["sensitivity"]["tokens"] == 64


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--budget", "0.5", "--allocation", "kl"], "--allocation 'kl': choose one of global"),
        (["--rank", "4", "--allocation", "global"], "--allocation splits a budget"),
        (["--budget", "0.5", "--allocation", "sensitivity"], "give --calibration STATS"),
    ],
)
def test_refusals_write_nothing(tmp_path: Path, capsys, args: list[str], message: str) -> None:
    out = tmp_path / "theta"
    assert cli(["decompose", "demo", "-o", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_statistics_without_sensitivities_are_refused(tmp_path: Path, capsys, tiny) -> None:
    model, data = tiny
    stats = tmp_path / "stats.safetensors"
    assert cli(["calibrate", str(model), "-o", str(stats), "--data", data, *FEW]) == 0
    capsys.readouterr()
    out = tmp_path / "theta"
    argv = ["decompose", str(model), "-o", str(out), "--budget", "0.5", "--calibration", str(stats)]
    assert cli([*argv, "--allocation", "sensitivity"]) == 2
    err = capsys.readouterr().err
    assert "--sensitivity" in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()
