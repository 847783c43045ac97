"""What `attnquant serve` prints: attnquant's own few lines, MAX's output in a log file it names
(everything on the terminal with ``--verbose``), and the log's tail when a start fails."""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import pytest

from attnquant_cli import cli

pytest.importorskip("attnquant_max")

#: The issue's bound on what a first start prints before it is ready.
MAX_LINES_BEFORE_READY = 40


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fake_gateway(monkeypatch, seen: list, *, code: int, max_lines: list[str] = ()):
    """``run_gateway`` replaced: records the max serve argv and env, writes ``max_lines`` to
    the log the argv names (when it names one), returns ``code``."""

    def run_gateway(path, *, argv_for, env, log, **kwargs) -> int:
        argv = argv_for(4321)
        seen.append((argv, env))
        if argv[:2] == [sys.executable, "-c"]:
            Path(argv[3]).write_text("".join(line + "\n" for line in max_lines))
        log("attnquant: MAX model server exited with code 1 before it was ready")
        return code

    monkeypatch.setattr("attnquant_max.gateway.run_gateway", run_gateway)


def test_serve_sends_max_to_its_log_and_prints_the_tail_when_the_start_fails(
    monkeypatch, tmp_path, capsys
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # MAX does not run here
    seen: list = []
    lines = [f"09:00:00.000 INFO: line {i}" for i in range(50)]
    lines += ["Traceback (most recent call last):", "RuntimeError: boom"]
    _fake_gateway(monkeypatch, seen, code=1, max_lines=lines)
    port = _free_port()
    assert cli(["serve", "--port", str(port)]) == 1
    err = capsys.readouterr().err.splitlines()
    log = (tmp_path / "attnquant" / f"max-serve-{port}.log").resolve()
    ((argv, env),) = seen
    assert argv[3] == str(log)  # max serve's stdout and stderr go there
    assert "serve" in argv[4:] and "--model-path" in argv[4:]  # then run as max serve
    assert env["PYTHONUNBUFFERED"] == "1"
    assert f"attnquant: MAX's log: {log} (--verbose prints it here)" in err
    header = err.index(f"attnquant: the last 40 lines of MAX's log ({log}):")
    assert err[header + 1 :] == [*lines[-40:], "attnquant: server stopped"]
    assert "RuntimeError: boom" not in err[:header]  # not said twice


def test_serve_verbose_leaves_max_on_the_terminal(monkeypatch, tmp_path, capsys) -> None:
    seen: list = []
    _fake_gateway(monkeypatch, seen, code=1)
    assert cli(["serve", "--port", str(_free_port()), "--verbose"]) == 1
    err = capsys.readouterr().err
    ((argv, env),) = seen
    assert argv[:2] != [sys.executable, "-c"] and "serve" in argv  # max serve itself
    assert env.get("PYTHONUNBUFFERED") == os.environ.get("PYTHONUNBUFFERED")
    assert "MAX's log" not in err
    assert "lines of MAX's log" not in err


def test_serve_max_log_option(monkeypatch, tmp_path, capsys) -> None:
    seen: list = []
    _fake_gateway(monkeypatch, seen, code=0, max_lines=["09:00:00.000 INFO: x"])
    given = tmp_path / "sub" / "max.log"
    assert cli(["serve", "--port", str(_free_port()), "--max-log", str(given)]) == 0
    assert given.read_text() == "09:00:00.000 INFO: x\n"
    assert f"attnquant: MAX's log: {given.resolve()}" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.xdist_group("serve-e2e")
@pytest.mark.usefixtures("demo_graph")
def test_a_start_prints_a_few_lines_and_keeps_max_in_its_log(demo, serve_model, tmp_path):
    """The demo served as the other served tests serve it (the graph cached by then)."""
    log, max_log = tmp_path / "serve.log", tmp_path / "max.log"
    with serve_model(demo, log, name="demo", args=["--max-log", str(max_log)]) as server:
        deadline = time.monotonic() + 30  # the ready line follows /health by under a second
        while "attnquant: ready to serve at " not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        assert server.stop() == 0
    lines = log.read_text().splitlines()
    ready = next(i for i, line in enumerate(lines) if line.startswith("attnquant: ready to"))
    assert ready + 1 <= MAX_LINES_BEFORE_READY, "\n".join(lines)
    assert lines[ready].startswith(f"attnquant: ready to serve at {server.url} in ")
    assert "MAX keeps compiled graphs in its cache" in lines[ready]
    assert f"attnquant: MAX's log: {max_log.resolve()} (--verbose prints it here)" in lines
    assert any("building and compiling the model graph" in line for line in lines[:ready])
    assert sum(line.startswith("attnquant: serving ") for line in lines) == 1  # said once
    assert lines[-1] == "attnquant: server stopped"
    text = "\n".join(lines)
    assert "Pipeline Configuration" not in text and "Server ready on" not in text
    kept = max_log.read_text()  # MAX's own output, in full
    assert "Pipeline Configuration" in kept
    assert "Building, compiling, and initializing model took" in kept
    assert "Server ready on" in kept
