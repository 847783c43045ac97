"""Fixtures shared by the integration tests: the demo model, its theta checkpoints, a server.

The session runs on pytest-xdist workers (the noxfile passes ``-n``). The tests that serve the
demo through MAX are split into a few ``xdist_group``s, and each of them first asks for
:func:`demo_graph`: the first worker to get there compiles the demo's graph while the others
wait, so two workers never compile the same graph side by side.
"""

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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from attnquant_cli import demo_model_path
from attnquant_core import decompose_checkpoint

# Generous: a cold MAX compile of the demo graph takes minutes on a loaded 2-core machine.
SERVER_READY_TIMEOUT_S = 1200


# The xdist groups that serve through MAX, longest first (the order xdist hands them out): the
# first compiles the demo's graph (demo_graph), "tiny" runs on the other worker meanwhile (its
# graphs are the tiny Llama's of attnquant-max's tests, cached by then in a full run);
# "demo-eval-max" compiles a graph of its own (the demo built with enable_echo).
SERVING_GROUPS = (
    "serve-reliability",
    "tiny",
    "demo-eval-max",
    "serve-clients",
    "serve-e2e",
    "demo-verify",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the groups that serve first, longest first; the quick tests fill in after."""

    def rank(item: pytest.Item) -> int:
        mark = item.get_closest_marker("xdist_group")
        name = mark.args[0] if mark is not None and mark.args else None
        return SERVING_GROUPS.index(name) if name in SERVING_GROUPS else len(SERVING_GROUPS)

    items.sort(key=rank)  # stable: each group's tests keep their order


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


@pytest.fixture(scope="session")
def demo_graph(demo: Path) -> None:
    """The demo's stock graph in MAX's cache before a test serves the demo.

    Under xdist the first worker here loads the demo (``load_pipeline`` with the CLI's defaults:
    the graph ``attnquant serve``, ``verify`` and ``generate`` all use) holding a lock; a worker
    that comes while it compiles waits, then finds the graph cached. Without xdist there is no
    one to race: the first test compiles it as it goes.
    """
    if os.environ.get("PYTEST_XDIST_TESTRUNUID") is None:
        return
    from attnquant_max import ServingOptions, load_pipeline
    from attnquant_max.testing import graph_lock

    options = ServingOptions(path="precompute-outside")
    with graph_lock("demo"), load_pipeline(demo, max_length=512, max_batch_size=8, options=options):
        pass


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
    model: Path,
    log: Path,
    *,
    name: str = "m",
    env: dict | None = None,
    args: Sequence[str] = (),
) -> Iterator[Server]:
    """Run ``attnquant serve`` (with ``args``) on a free loopback port until ``/v1/models``
    answers; its terminal output goes to ``log``, MAX's log beside it (``NAME.max.log``)
    unless ``args`` say otherwise."""
    port = _free_port()
    if "--max-log" not in args:
        args = [*args, "--max-log", str(log.with_suffix(".max.log"))]
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
        *args,
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
def serve_model(demo_graph: None):
    """``serve_model(path, log, name=..., env=..., args=...)``: a context manager around
    ``attnquant serve``."""
    return attnquant_serve
