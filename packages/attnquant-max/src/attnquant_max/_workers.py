"""MAX's CPU runtime workers at a lower priority than the Python thread that drives each step.

MAX 26.7's CPU runtime runs a graph on one worker thread per core (named ``🔥 Thread<N>``), and an
idle worker spins for 0.1-0.2 s after a graph before it sleeps. Between two graphs of a decode
step the pipeline's Python (batch and cache inputs, the sampler's inputs, the context updates)
then shares the cores with the spinning workers: on a 2-core machine three threads want two
cores, and the scheduler hands the driving thread its core only a slice later. A worker with a
higher nice value yields to it at once; the graphs themselves run as before, since the driving
thread sleeps while they run. docs/decode-speed.md has the measurements.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

__all__ = ["lower_worker_priority", "runtime_workers"]

logger = logging.getLogger(__name__)

#: A thread name (``/proc/<pid>/task/<tid>/comm``) of MAX's CPU runtime: ``🔥 Thread0``, ...
WORKER_NAME = re.compile(r"(?:^|\s)Thread\d+$")


def runtime_workers(proc: Path = Path("/proc/self")) -> list[int]:
    """The thread ids of this process's CPU runtime workers (empty where ``/proc`` has no
    per-thread names, as off Linux)."""
    tasks = proc / "task"
    if not tasks.is_dir():
        return []
    main = os.getpid()
    found = []
    for task in tasks.iterdir():
        try:
            name = (task / "comm").read_text(encoding="utf-8", errors="replace").strip()
        except OSError:  # the thread ended between the listing and the read
            continue
        if task.name.isdigit() and int(task.name) != main and WORKER_NAME.search(name):
            found.append(int(task.name))
    return sorted(found)


def lower_worker_priority(nice: int) -> int:
    """Give every CPU runtime worker of this process at least ``nice`` (never raising its
    priority, which needs a privilege); returns how many workers now run at ``nice`` or above.

    A nice value is per thread on Linux, and threads a worker starts inherit it.
    """
    if nice <= 0:
        return 0
    count = 0
    for tid in runtime_workers():
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
            count += 1
        except ProcessLookupError:  # the worker ended meanwhile
            continue
    return count
