"""attnquant-cli without attnquant-max (the ``serve`` extra): the numpy commands run, the
serving ones refuse in one line naming the extra.

attnquant-max is made unimportable here (``sys.modules["attnquant_max"] = None``), so these
tests say the same whether or not the session installed it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from attnquant_cli import cli, demo_model_path
from attnquant_cli._eval import choose_forward
from attnquant_cli._extra import ServeExtraError, require_max

MESSAGE = "needs attnquant-max: pip install 'attnquant-cli[serve]'"


@pytest.fixture
def no_max(monkeypatch: pytest.MonkeyPatch) -> None:
    """As if attnquant-max were not installed: importing it raises ModuleNotFoundError."""
    monkeypatch.setitem(sys.modules, "attnquant_max", None)


@pytest.mark.parametrize(
    "argv",
    [
        ["serve"],
        ["generate", "--prompt", "x"],
        ["verify", "demo", "demo"],
        ["bench", "demo", "demo"],
        ["eval", "demo", "--forward", "max", "--samples", "1"],
    ],
    ids=["serve", "generate", "verify", "bench", "eval-max"],
)
def test_a_serving_command_without_attnquant_max_is_one_line(no_max, argv, capsys) -> None:
    assert cli(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    command = " ".join(argv[:1] + (["--forward", "max"] if argv[0] == "eval" else []))
    assert err == [f"error: attnquant {command} {MESSAGE}"]


def test_require_max_names_the_command_and_is_an_import_error(no_max) -> None:
    with pytest.raises(ServeExtraError, match=r"^attnquant serve needs attnquant-max: pip") as e:
        require_max("serve")
    assert isinstance(e.value, ImportError)


def test_require_max_passes_other_missing_modules_on(monkeypatch) -> None:
    """A module attnquant-max itself imports missing is a broken install, not the extra."""

    def fail(*args: object, **kwargs: object) -> None:
        raise ModuleNotFoundError("No module named 'something_else'", name="something_else")

    monkeypatch.delitem(sys.modules, "attnquant_max", raising=False)
    monkeypatch.setattr("builtins.__import__", fail)
    with pytest.raises(ModuleNotFoundError, match="something_else"):
        require_max("serve")


def test_eval_auto_falls_back_to_numpy_and_says_why(no_max, capsys) -> None:
    chosen, why = choose_forward("auto", [demo_model_path()], devices="cpu", float64=False)
    assert chosen == "numpy"
    assert why == "auto: attnquant-max is not installed (pip install 'attnquant-cli[serve]')"
    assert cli(["eval", "demo", "--samples", "1", "--seq-len", "16", "--json"]) == 0
    captured = capsys.readouterr()
    assert f"eval: numpy forward, {why}" in captured.err.splitlines()
    payload = json.loads(captured.out.strip().splitlines()[-1])
    assert payload["forward"] == "numpy" and payload["forward_why"] == why


def test_export_runs_without_attnquant_max(no_max, tmp_path, capsys) -> None:
    """The Model Optimizer NVFP4 writer is attnquant-core's (numpy)."""
    out = tmp_path / "nvfp4"
    assert cli(["export", "demo", "-o", str(out), "--json"]) == 0
    assert (out / "hf_quant_config.json").is_file()


def test_the_numpy_commands_import_no_attnquant_max() -> None:
    """Importing the command line (every command registered) loads neither attnquant-max nor
    attnquant-kernels nor MAX."""
    code = (
        "import sys, attnquant_cli._app; "
        "bad = [m for m in ('attnquant_max', 'attnquant_kernels', 'max') if m in sys.modules]; "
        "sys.exit(str(bad) if bad else 0)"
    )
    run = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
