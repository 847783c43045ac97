"""A quiet start: MAX's start-up output turned into attnquant's few lines.

``attnquant serve`` sends the ``max serve`` child's output to a log file (:func:`logged_command`)
and follows it (:class:`LogFollower`); ``attnquant generate`` hands MAX's log records over in
process (:func:`quiet_max_logging`). Either way :class:`StartupReport` says what MAX is
compiling, how long it has taken, and when the model is ready, and lets through what matters:
attnquant's own lines, MAX's warnings and errors, tracebacks. ``--verbose`` skips all of it.

MAX 26.7 names what it compiles in its log ("Building, compiling, and initializing model...");
that is read here, and a MAX that says it otherwise still gets the elapsed-time lines. Whether
a compile was a first one or a load from MAX's cache cannot be told from outside MAX: the lines
say how long it took, not which it was.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

__all__ = [
    "LogFollower",
    "StartupReport",
    "default_log_path",
    "log_tail",
    "logged_command",
    "progress_ticks",
    "quiet_max_logging",
    "split_record",
]

#: One record of MAX's console log: ``09:29:42.159 INFO: message`` (its non-structured format).
_RECORD = re.compile(r"^\d\d:\d\d:\d\d\.\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL):(?: (.*))?$")
_STARTS = re.compile(r"^Building, compiling, and initializing (.+?)\.\.\.$")
_TOOK = re.compile(r"^Building, compiling, and initializing (.+?) took ([0-9.]+) seconds$")
#: How the attnquant_max logger's messages begin (MAX's own never do).
_OURS = ("attnquant:", "NVFP4")
_SHOWN_LEVELS = ("WARNING", "ERROR", "CRITICAL")


def _max_cache() -> str:
    """MAX 26.7's cache folder, as the ready line names it (it follows ``XDG_CACHE_HOME``)."""
    base = os.environ.get("XDG_CACHE_HOME")
    return "~/.cache/modular" if not base else str(Path(base) / "modular")


def split_record(line: str) -> tuple[str | None, str]:
    """``(level, message)`` of a line of MAX's log; ``(None, line)`` for a line that continues
    a record (a traceback, MAX's banner) or that MAX printed outside its logger."""
    match = _RECORD.match(line)
    if match is None:
        return None, line
    return match.group(1), match.group(2) or ""


class StartupReport:
    """What attnquant prints while MAX starts: ``say`` gets each line.

    Feed it MAX's output (:meth:`line` for a log line, :meth:`record` for a parsed record),
    call :meth:`tick` now and then (a progress line once ``every_s`` passed without one, the
    wait doubling with each progress line in a row up to ``most_s``, so that a compile of an
    hour still prints a few lines), and
    :meth:`ready` once; times count from ``started`` (a ``clock()`` reading; default now).

    Said as they come: what MAX compiles and how long it took; attnquant's own lines, each
    once (``shown``: already printed, as the plan line the ``attnquant_max`` logger repeats at
    load); MAX's warnings and errors, their first line until the model is ready, whole after;
    tracebacks once it is ready (a start that fails shows the log's tail instead).
    """

    def __init__(
        self,
        say: Callable[[str], None],
        *,
        shown: Iterable[str] = (),
        every_s: float = 20.0,
        most_s: float = 160.0,
        clock: Callable[[], float] = time.monotonic,
        started: float | None = None,
    ) -> None:
        self.say = say
        self.every_s = every_s
        self.most_s = most_s
        self._wait_s = every_s  # until the next progress line; doubles while nothing else is said
        self.clock = clock
        self.last_said = self.phase_started = clock()
        self.started = self.last_said if started is None else started
        self.phase = "starting MAX"
        self.is_ready = False
        self._shown = set(shown)
        self._echoing = False  # continuation lines of an echoed record are echoed too
        self._lock = threading.Lock()  # the follower thread and the caller may both say

    def _say(self, text: str, *, progress: bool = False) -> None:
        self.last_said = self.clock()
        self._wait_s = min(2 * self._wait_s, self.most_s) if progress else self.every_s
        self.say(text)

    def line(self, text: str) -> None:
        """One line of ``max serve``'s output."""
        self.record(*split_record(text.rstrip("\r\n")))

    def record(self, level: str | None, message: str) -> None:
        """One record of MAX's log (``level`` None: a line continuing the last record)."""
        with self._lock:
            if level is None:
                # Before ready, a fatal traceback is in the log's tail the CLI prints.
                if message.startswith("Traceback (most recent call last):") and self.is_ready:
                    self._echoing = True
                if self._echoing:
                    self._say(message)
                return
            self._echoing = False
            if message.startswith(_OURS):
                if self.once(message):
                    self._say(message)
            elif level in _SHOWN_LEVELS:
                self._echoing = self.is_ready
                self._say(f"MAX {level}: {message}")
            elif not self.is_ready:
                self._phase(message)

    def once(self, message: str) -> bool:
        """True the first time ``message`` is asked about (or shown), False after."""
        first = message not in self._shown
        self._shown.add(message)
        return first

    def _phase(self, message: str) -> None:
        if match := _STARTS.match(message):
            self.phase = f"compiling the {match.group(1)} graph"
            self.phase_started = self.clock()
            self._say(
                f"attnquant: MAX is building and compiling the {match.group(1)} graph "
                "(minutes on a first start; seconds when MAX has it cached)"
            )
        elif match := _TOOK.match(message):
            self.phase = "finishing MAX's start"
            self._say(
                f"attnquant: the {match.group(1)} graph built, compiled and initialized in "
                f"{float(match.group(2)):.1f} s"
            )

    def tick(self) -> None:
        """Say how long the start has taken when nothing was said for a while (``every_s``,
        doubling with each progress line in a row, at most ``most_s``)."""
        with self._lock:
            now = self.clock()
            if self.is_ready or now - self.last_said < self._wait_s:
                return
            in_phase = now - self.phase_started
            since = now - self.started
            if self.phase.startswith("compiling") and in_phase < since - 1:
                text = f"attnquant: {self.phase}, {in_phase:.0f} s ({since:.0f} s since start)"
            else:
                text = f"attnquant: {self.phase}, {since:.0f} s since start"
            self._say(text, progress=True)

    def ready(self, what: str) -> None:
        """The ready line: ``what`` ("ready to serve at URL"), how long it took, and that MAX
        caches what it compiled."""
        with self._lock:
            self.is_ready = True
            seconds = self.clock() - self.started
            self._say(
                f"attnquant: {what} in {seconds:.0f} s; MAX keeps compiled graphs in its cache "
                f"({_max_cache()}): the next start skips the compile"
            )


# -- serve: the max serve child's output in a log file -------------------------------------------

# Runs in place of max serve for the instant it takes to point stdout and stderr at the log,
# then execs it: the same process (pid, group, parent-death signal, signals), so ServerProcess
# and its watchdog supervise max serve exactly as they would unlogged.
_TO_LOG = (
    "import os, sys; fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644); "
    "os.dup2(fd, 1); os.dup2(fd, 2); os.close(fd); os.execvp(sys.argv[2], sys.argv[2:])"
)


def logged_command(argv: Iterable[str], log: str | os.PathLike[str]) -> list[str]:
    """``argv`` with its stdout and stderr appended to ``log`` (it then runs as ``argv``)."""
    return [sys.executable, "-c", _TO_LOG, os.fspath(log), *argv]


def default_log_path(port: int) -> Path:
    """Where ``attnquant serve --port PORT`` writes MAX's log: the user's cache, one per port."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "attnquant" / f"max-serve-{port}.log"


def log_tail(path: str | os.PathLike[str], lines: int = 40) -> list[str]:
    """The last ``lines`` lines of ``path`` (none when it cannot be read)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as log:
            return [line.rstrip("\n") for line in deque(log, maxlen=lines)]
    except OSError:
        return []


class LogFollower(threading.Thread):
    """Feeds the lines appended to MAX's log to a :class:`StartupReport`, ticks it, and calls
    its :meth:`~StartupReport.ready` once ``health_url`` answers 200; :meth:`stop` ends it."""

    def __init__(
        self, path: str | os.PathLike[str], report: StartupReport, health_url: str, what: str
    ) -> None:
        super().__init__(name="attnquant-max-log", daemon=True)
        self.path, self.report, self.health_url, self.what = Path(path), report, health_url, what
        self._done = threading.Event()

    def run(self) -> None:
        pending = b""
        with contextlib.ExitStack() as stack:
            log = None
            while True:
                stopping = self._done.is_set()
                if log is None and self.path.exists():
                    log = stack.enter_context(open(self.path, "rb"))
                while log is not None and (chunk := log.read(1 << 16)):
                    pending += chunk
                    *lines, pending = pending.split(b"\n")
                    for line in lines:
                        self.report.line(line.decode("utf-8", errors="replace"))
                if stopping:
                    return
                if not self.report.is_ready:
                    if self._healthy():
                        self.report.ready(self.what)
                    else:
                        self.report.tick()
                self._done.wait(0.5)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.health_url, timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        """Read what is left of the log, then end the thread."""
        self._done.set()
        self.join(timeout=5)


# -- generate: MAX in process --------------------------------------------------------------------


class _Relay(logging.Handler):
    """On a logger that no longer propagates: hands each record to ``keep``, and on to the root
    logger's handlers (where propagation would have taken it) when ``keep`` says so."""

    def __init__(self, keep: Callable[[logging.LogRecord], bool]) -> None:
        super().__init__()
        self.keep = keep

    def emit(self, record: logging.LogRecord) -> None:
        if self.keep(record):
            for handler in logging.getLogger().handlers:
                if record.levelno >= handler.level:
                    handler.handle(record)


@contextlib.contextmanager
def quiet_max_logging(report: StartupReport) -> Iterator[None]:
    """While in the block, MAX's records below WARNING go to ``report`` only (its compile
    lines) and each of attnquant's lines reaches the handlers once; warnings and errors pass."""

    def max_record(record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return True
        report.record(record.levelname, record.getMessage())
        return False

    def ours(record: logging.LogRecord) -> bool:
        return report.once(record.getMessage()) or record.levelno >= logging.WARNING

    stock = logging.getLogger("max")
    loggers = [(stock, _Relay(max_record)), (logging.getLogger("attnquant_max"), _Relay(ours))]
    saved = [(logger.propagate, logger.level) for logger, _ in loggers]
    for logger, relay in loggers:
        logger.addHandler(relay)
        logger.propagate = False
    if stock.getEffectiveLevel() > logging.INFO:
        stock.setLevel(logging.INFO)  # the report reads MAX's INFO records, whatever the root's
    try:
        yield
    finally:
        for (logger, relay), (propagate, level) in zip(loggers, saved, strict=True):
            logger.removeHandler(relay)
            logger.propagate = propagate
            logger.setLevel(level)


@contextlib.contextmanager
def progress_ticks(report: StartupReport, every_s: float = 1.0) -> Iterator[None]:
    """A thread calling ``report.tick()`` every ``every_s`` while in the block."""
    done = threading.Event()

    def tick() -> None:
        while not done.wait(every_s):
            report.tick()

    thread = threading.Thread(target=tick, name="attnquant-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=5)
