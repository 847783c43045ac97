"""``attnquant eval --forward`` where attnquant-max is installed: which forward runs, and why.

Moved from attnquant-cli's tests, whose session has no attnquant-max (the ``serve`` extra): the
reasons here come from :func:`attnquant_max.max_unavailable`. Nothing compiles a MAX graph.
"""

from __future__ import annotations

import json
from pathlib import Path

from attnquant_cli import cli, demo_model_path
from attnquant_cli._eval import choose_forward


def _model(tmp_path: Path, architecture: str) -> Path:
    path = tmp_path / architecture
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    return path


def test_auto_takes_max_for_the_demo_on_a_cpu():
    chosen, why = choose_forward("auto", [demo_model_path()], devices="cpu", float64=False)
    assert chosen == "max" and "runs in MAX on cpu" in why


def test_auto_falls_back_to_numpy_and_says_why(tmp_path):
    other = _model(tmp_path, "MambaForCausalLM")
    chosen, why = choose_forward("auto", [demo_model_path(), other], devices="cpu", float64=False)
    assert chosen == "numpy" and "MambaForCausalLM" in why and why.startswith("auto: ")
    gemma = _model(tmp_path, "Gemma3ForConditionalGeneration")
    chosen, why = choose_forward("auto", [gemma], devices="cpu", float64=False)
    assert chosen == "numpy" and "needs a GPU" in why


def test_forward_max_on_an_architecture_max_does_not_run_is_one_line(tmp_path, capsys):
    other = _model(tmp_path, "MambaForCausalLM")
    rc = cli(["eval", "demo", str(other), "--forward", "max", "--samples", "1", "--json"])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--forward max" in err[0] and "MambaForCausalLM" in err[0]


def test_decode_steps_need_the_max_forward(capsys):
    rc = cli(["eval", "demo", "--forward", "numpy", "--decode-steps", "--samples", "1"])
    assert rc == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--decode-steps needs the MAX forward" in err and "--forward numpy" in err
