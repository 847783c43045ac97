"""Root pytest plugin, loaded by every test session: a log of the MAX graphs each test compiles,
a check that pytest-xdist keeps each ``xdist_group`` (one compiled graph) on one worker, and
MAX's one import-time Mojo build done before the workers start.

Set ``ATTNQUANT_COMPILE_LOG=FILE`` and every test appends one JSON line per test that compiled a
graph (in this process or in a child, such as ``max serve``): its node id, how many new graphs
appeared in MAX's cache, their cache names and the test's wall time, setup and teardown included
(session fixtures compile in the setup of the first test that needs them). A graph in MAX's cache
is one ``.max_cache/mof/mef/<version>/<hash>`` file, written when a compile finishes.
``scripts/cold_ci.py`` runs the whole CI with an empty cache and tabulates this log.

Standard library only: attnquant-core's session has no MAX.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import time
from pathlib import Path

import pytest


def max_graph_cache() -> Path:
    """Where MAX 26.7 keeps compiled graphs (it follows ``XDG_CACHE_HOME``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "modular" / ".max_cache" / "mof" / "mef"


def _graphs() -> set[str]:
    root = max_graph_cache()
    if not root.is_dir():
        return set()
    # MAX writes ``<hash>.lock`` beside a graph while compiling it: not a graph.
    return {p.relative_to(root).as_posix() for p in root.glob("*/*") if p.suffix != ".lock"}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    log = os.environ.get("ATTNQUANT_COMPILE_LOG")
    if not log:
        yield
        return
    before, start = _graphs(), time.monotonic()
    yield
    new = sorted(_graphs() - before)
    if new:
        record = {
            "test": item.nodeid,
            "graphs": len(new),
            "names": new,
            "seconds": round(time.monotonic() - start, 1),
            "session": os.environ.get("ATTNQUANT_CI_SESSION", ""),
            # Under pytest-xdist: the worker, and when the test ran (a graph compiled by the
            # other worker meanwhile appears here too; scripts/cold_ci.py counts it once).
            "worker": os.environ.get("PYTEST_XDIST_WORKER", ""),
            "started": round(time.time() - (time.monotonic() - start), 1),
        }
        with open(log, "a", encoding="utf-8") as sink:
            sink.write(json.dumps(record) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    """On the pytest-xdist controller, build MAX's import-time Mojo module before any worker starts.

    ``import max.nn`` compiles ``max/_kv_cache_ops`` into ``__mojocache__`` in site-packages on
    first use (about 10 s), writing the ``.so`` in place with no lock: two workers importing a
    fresh environment at once can load a half-written file ("file too short"), as a cold CI did.
    Once built, the import takes about 0.5 s.
    """
    if not getattr(config.option, "numprocesses", None) or hasattr(config, "workerinput"):
        return
    if importlib.util.find_spec("max") is not None:
        importlib.import_module("max._kv_cache_ops")


def pytest_runtest_setup(item: pytest.Item) -> None:
    """On an xdist worker under ``--dist loadgroup``, fail a grouped test whose group was lost.

    xdist marks a grouped test by suffixing its node id with ``@group``; with pytest 9.2 that
    silently stopped working (pytest-dev/pytest-xdist#1386) and the workers compiled the same
    graphs side by side. Failing here makes such an upgrade loud instead of slow.
    """
    if (
        getattr(item.config.option, "loadgroup", False)
        and item.get_closest_marker("xdist_group") is not None
        and "@" not in item.nodeid
    ):
        pytest.fail(
            "pytest-xdist lost this test's xdist_group (pytest-dev/pytest-xdist#1386): see the "
            "pytest constraint in pyproject.toml",
            pytrace=False,
        )
