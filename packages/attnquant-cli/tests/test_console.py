"""Output that is not a terminal is never wrapped, whatever the width, path or COLUMNS."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.table import Table

from attnquant_cli import cli
from attnquant_cli._console import UNWRAPPED_WIDTH, Output
from attnquant_core.testing import make_structured_weights, write_checkpoint

LONG = "a-directory-name-long-enough-to-cross-any-terminal-edge-" * 4


@pytest.mark.parametrize("columns", ["40", "80", None])
def test_captured_lines_come_out_whole(capsys, monkeypatch, columns):
    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)
    console = Output()
    line = f"{LONG}: 42 projections in NVFP4, 15 tensors copied"
    console.print(line, highlight=False)
    table = Table(title=LONG)
    table.add_column("family")
    table.add_row(LONG)
    console.print(table)
    console.print_table(table)
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == line
    assert printed[1].strip() == LONG  # the title, centred but whole
    assert any(LONG in row for row in printed[2:])
    assert console.width == UNWRAPPED_WIDTH


def test_a_terminal_still_wraps_at_its_width():
    with open(os.devnull, "w") as sink:
        console = Output(file=sink, force_terminal=True, width=50)
        assert console.width == 50


def test_piped_cli_keeps_paths_whole(tmp_path):
    """A real process with its stdout on a pipe and COLUMNS=40: the table title holds the path."""
    src = write_checkpoint(tmp_path / "src", make_structured_weights(2, kind="shared"))
    output = tmp_path / LONG / "theta"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "attnquant_cli",
            "decompose",
            str(src),
            "-o",
            str(output),
            "--rank",
            "2",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "40"},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert any(str(output) in line for line in done.stdout.splitlines()), done.stdout


def test_decompose_json_is_one_object_on_stdout(tmp_path, capsys):
    src = write_checkpoint(tmp_path / "src", make_structured_weights(2, kind="shared"))
    output = tmp_path / "theta"
    assert cli(["decompose", str(src), "-o", str(output), "--rank", "2", "--json"]) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)  # the only thing on stdout
    assert summary["output"] == str(output)
    assert (summary["blocks"], summary["rank"]) == (1, 2)
    manifest = json.loads((output / "attnquant.json").read_text())
    assert summary["families"].keys() == manifest["families"].keys()
    for name, family in summary["families"].items():
        assert family["error"] == manifest["families"][name]["error"]
    assert summary["stored_parameters"] == sum(
        f["stored_parameters"] for f in manifest["families"].values()
    )
    assert "rel. error" in captured.err  # the table went to stderr


def test_budget_json_carries_the_budget(tmp_path, capsys):
    src = write_checkpoint(tmp_path / "src", make_structured_weights(2, kind="shared"))
    output = tmp_path / "theta"
    assert cli(["decompose", str(src), "-o", str(output), "--budget", "0.5", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["budget"]["budget"] == 0.5
    assert summary["stored_parameters"] <= 0.5 * summary["dense_parameters"]
    assert Path(summary["output"]) == output
