"""Fixtures shared by the integration tests: the demo model, its theta checkpoints, a server."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from attnquant_cli import demo_model_path
from attnquant_core import decompose_checkpoint

# Generous: a cold MAX compile of the demo graph takes minutes on a loaded 2-core machine.
SERVER_READY_TIMEOUT_S = 1200


@pytest.fixture(scope="session")
def demo() -> Path:
    return demo_model_path()


@pytest.fixture(scope="session")
def theta_dir(tmp_path_factory, demo):
    """Factory: the demo model decomposed at (blocks, rank), made once per session."""
    made: dict[tuple[object, int], Path] = {}

    def make(blocks: int | str, rank: int) -> Path:
        if (blocks, rank) not in made:
            out = tmp_path_factory.mktemp("theta") / f"demo-G{blocks}-r{rank}"
            decompose_checkpoint(demo, out, blocks=blocks, rank=rank)
            made[(blocks, rank)] = out
        return made[(blocks, rank)]

    return make


@dataclass
class Server:
    url: str
    model: str
    proc: subprocess.Popen
    log: Path

    def stop(self) -> int:
        """Ctrl-C, as a user would; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def attnquant_serve(
    model: Path, log: Path, *, name: str = "m", env: dict | None = None
) -> Iterator[Server]:
    """Run ``attnquant serve`` on a free loopback port until ``/v1/models`` answers."""
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "attnquant_cli",
        "serve",
        str(model),
        "--port",
        str(port),
        "--served-model-name",
        name,
    ]
    with open(log, "wb") as sink:
        proc = subprocess.Popen(
            cmd, stdout=sink, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
    server = Server(f"http://127.0.0.1:{port}/v1", name, proc, log)
    try:
        deadline = time.monotonic() + SERVER_READY_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(
                    f"attnquant serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
                )
            try:
                with urllib.request.urlopen(f"{server.url}/models", timeout=5) as r:
                    if name in json.load(r)["data"][0]["id"]:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(
                    f"attnquant serve not ready in {SERVER_READY_TIMEOUT_S}s:\n{log.read_text()[-3000:]}"
                )
            time.sleep(2)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def serve_model():
    """``serve_model(path, log, name=..., env=...)``: a context manager around ``attnquant serve``."""
    return attnquant_serve
