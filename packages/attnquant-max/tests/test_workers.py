"""MAX's CPU runtime workers found by name and given a nice value, never a higher priority."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from attnquant_max._workers import WORKER_NAME, lower_worker_priority, runtime_workers

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="per-thread names and nice values are Linux's"
)


@contextmanager
def named_thread(name: str) -> Iterator[int]:
    """A live thread whose kernel name is ``name``; yields its thread id."""
    ready, done = threading.Event(), threading.Event()
    tid: list[int] = []

    def body() -> None:
        tid.append(threading.get_native_id())
        with open(f"/proc/self/task/{tid[0]}/comm", "w", encoding="utf-8") as comm:
            comm.write(name)
        ready.set()
        done.wait(30)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        yield tid[0]
    finally:
        done.set()
        thread.join(10)


@pytest.mark.parametrize(
    ("name", "worker"),
    [
        ("\N{FIRE} Thread0", True),
        ("\N{FIRE} Thread12", True),
        ("Thread3", True),
        ("python", False),
        ("Thread-1", False),
        ("Thread0 (x)", False),
        ("MyThread", False),
    ],
)
def test_worker_names(name: str, worker: bool) -> None:
    assert bool(WORKER_NAME.search(name)) is worker


def test_only_runtime_workers_are_found() -> None:
    with named_thread("\N{FIRE} Thread9") as worker, named_thread("helper") as helper:
        found = runtime_workers()
        assert worker in found
        assert helper not in found
        assert os.getpid() not in found


def test_a_worker_gets_the_nice_value_and_others_keep_theirs() -> None:
    main = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with named_thread("\N{FIRE} Thread8") as worker, named_thread("helper") as helper:
        before = os.getpriority(os.PRIO_PROCESS, helper)
        assert lower_worker_priority(0) == 0
        assert os.getpriority(os.PRIO_PROCESS, worker) == main
        assert lower_worker_priority(max(main, 0) + 7) >= 1
        assert os.getpriority(os.PRIO_PROCESS, worker) == max(main, 0) + 7
        assert os.getpriority(os.PRIO_PROCESS, helper) == before
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main
        # a lower value never raises a worker's priority back (that needs a privilege)
        assert lower_worker_priority(max(main, 0) + 2) >= 1
        assert os.getpriority(os.PRIO_PROCESS, worker) == max(main, 0) + 7
