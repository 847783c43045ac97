"""The command line itself: help, exit codes, and that MAX stays unimported until needed."""

from __future__ import annotations

import subprocess
import sys

from attnquant_cli import cli


def test_help_lists_the_commands(capsys):
    assert cli(["--help"]) == 0
    assert "decompose" in capsys.readouterr().out


def test_usage_error_exit_code(capsys):
    assert cli(["decompose"]) == 2
    assert "Missing argument" in capsys.readouterr().err


def test_import_does_not_load_max():
    code = "import sys, attnquant_cli; sys.exit(1 if 'max' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
