"""A quiet start: MAX's output turned into attnquant's few lines (attnquant_max._startup)."""

from __future__ import annotations

import http.server
import itertools
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from attnquant_max._startup import (
    LogFollower,
    StartupReport,
    default_log_path,
    log_tail,
    logged_command,
    progress_ticks,
    quiet_max_logging,
    split_record,
)

PLAN = "attnquant: serving dense checkpoint demo unchanged (passthrough, no rebuild)"

# What max serve 26.7 wrote for the demo on a warm start, cut short (the config dump elided).
MAX_LOG = f"""\
09:29:33.838 INFO: OTLP metrics export disabled.
09:29:42.159 INFO: ============================================================
09:29:42.159 INFO: Pipeline Configuration (use --pretty-print-config to print full config)
09:29:42.159 INFO:     architecture         : LlamaForCausalLM
09:29:42.159 INFO:
09:29:50.508 INFO: Initializing model pipeline...
09:29:52.912 INFO: {PLAN}
09:29:52.912 INFO: Building, compiling, and initializing model...
09:29:52.914 INFO: attnquant: 2 CPU runtime workers at nice 19
09:29:54.856 INFO: Compiling model took 1.0 seconds
09:29:54.857 INFO: Building, compiling, and initializing model took 1.9 seconds
09:29:54.858 INFO: Building, compiling, and initializing sampler...
09:29:56.806 INFO: Building, compiling, and initializing sampler took 1.9 seconds
09:29:56.973 INFO: Model worker ready
09:29:57.127 INFO:

********************************************************************************

        Server ready on http://127.0.0.1:54495 (Press CTRL+C to quit)

********************************************************************************
"""


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _report(**kwargs: object) -> tuple[StartupReport, list[str], Clock]:
    said: list[str] = []
    clock = Clock()
    return StartupReport(said.append, shown=[PLAN], clock=clock, **kwargs), said, clock


def test_split_record() -> None:
    assert split_record("09:29:42.159 INFO: devices: cpu[-1]") == ("INFO", "devices: cpu[-1]")
    assert split_record("09:29:42.159 WARNING: odd") == ("WARNING", "odd")
    assert split_record("09:29:42.159 INFO: ") == ("INFO", "")
    assert split_record("09:29:42.159 INFO:") == ("INFO", "")
    assert split_record("  File 'x.py', line 3") == (None, "  File 'x.py', line 3")
    assert split_record("Aborted!") == (None, "Aborted!")


def test_a_warm_start_is_a_few_lines_of_attnquants(monkeypatch) -> None:
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)  # MAX's cache then in ~/.cache
    report, said, clock = _report()
    for line in MAX_LOG.splitlines():
        report.line(line + "\n")
    clock.now += 27.4
    report.ready("ready to serve at http://h:1/v1")
    assert said == [
        "attnquant: MAX is building and compiling the model graph (minutes on a first start; "
        "seconds when MAX has it cached)",
        "attnquant: 2 CPU runtime workers at nice 19",
        "attnquant: the model graph built, compiled and initialized in 1.9 s",
        "attnquant: MAX is building and compiling the sampler graph (minutes on a first start; "
        "seconds when MAX has it cached)",
        "attnquant: the sampler graph built, compiled and initialized in 1.9 s",
        "attnquant: ready to serve at http://h:1/v1 in 27 s; MAX keeps compiled graphs in its "
        "cache (~/.cache/modular): the next start skips the compile",
    ]  # the plan line was shown already; the config dump and MAX's banner are not


def test_progress_lines_come_every_so_often_with_the_elapsed_time() -> None:
    report, said, clock = _report(every_s=20.0)
    clock.now += 19.0
    report.tick()
    assert said == []
    clock.now += 2.0
    report.tick()
    assert said == ["attnquant: starting MAX, 21 s since start"]
    report.line("09:00:00.000 INFO: Building, compiling, and initializing model...")
    clock.now += 10.0
    report.tick()  # 10 s after the last line: nothing yet
    clock.now += 10.0
    report.tick()
    clock.now += 5.0
    report.tick()
    assert said[-1] == "attnquant: compiling the model graph, 20 s (41 s since start)"
    assert len(said) == 3
    report.ready("model loaded")
    clock.now += 60.0
    report.tick()  # ready: no more progress lines
    assert said[-1].startswith("attnquant: model loaded in 46 s; ")


def test_progress_lines_space_out_so_an_hour_long_compile_prints_a_few() -> None:
    report, said, clock = _report(every_s=20.0)
    report.line("09:00:00.000 INFO: Building, compiling, and initializing model...")
    for _ in range(3600):
        clock.now += 1.0
        report.tick()
    progress = said[1:]
    gaps = [int(line.split(", ")[1].split(" s")[0]) for line in progress]
    assert gaps[:4] == [20, 60, 140, 300]  # waits of 20, 40, 80, 160 s, then 160 each
    assert all(b - a == 160 for a, b in itertools.pairwise(gaps[3:]))
    assert len(progress) <= 26
    report.line("09:00:00.000 INFO: Building, compiling, and initializing sampler...")
    clock.now += 21.0
    report.tick()  # something else was said: the wait is back to 20 s
    assert said[-1] == "attnquant: compiling the sampler graph, 21 s (3621 s since start)"


def test_each_attnquant_line_is_said_once() -> None:
    report, said, _ = _report()
    for _ in range(2):  # a restarted max serve logs them again
        report.line(f"09:00:00.000 INFO: {PLAN}")
        report.line("09:00:00.000 INFO: NVFP4 projections on cpu:0: fused")
    assert said == ["NVFP4 projections on cpu:0: fused"]


TRACEBACK = [
    "09:00:00.000 ERROR: Model worker died",
    "Traceback (most recent call last):",
    '  File "worker.py", line 3, in run',
    "RuntimeError: boom",
    "09:00:01.000 INFO: Shutting down workers...",
    "Traceback (most recent call last):",
    "  raw",
    "09:00:02.000 INFO: after",
]


def test_errors_pass_tracebacks_only_once_ready() -> None:
    report, said, _ = _report()
    for line in TRACEBACK:
        report.line(line)
    # Before ready a traceback stays in the log: a start that fails prints the log's tail.
    assert said == ["MAX ERROR: Model worker died"]
    said.clear()
    report.ready("ready")
    said.clear()
    for line in TRACEBACK:
        report.line(line)
    assert said == [
        "MAX ERROR: Model worker died",
        "Traceback (most recent call last):",
        '  File "worker.py", line 3, in run',
        "RuntimeError: boom",
        "Traceback (most recent call last):",
        "  raw",
    ]


def test_a_warning_is_one_line() -> None:
    report, said, _ = _report()
    report.line("09:00:00.000 WARNING: max_length is large")
    report.line("continued")
    assert said == ["MAX WARNING: max_length is large"]


def test_logged_command_runs_in_place_with_its_output_in_the_log(tmp_path: Path) -> None:
    log = tmp_path / "max.log"
    log.write_text("kept\n")
    child = "import os, sys; print(os.getpid()); print('to stderr', file=sys.stderr)"
    proc = subprocess.Popen(logged_command([sys.executable, "-c", child], log))
    assert proc.wait(timeout=60) == 0
    lines = log.read_text().splitlines()
    assert lines[0] == "kept"  # appended, as a restart appends
    assert set(lines[1:]) == {str(proc.pid), "to stderr"}  # exec'd: the same process


def test_default_log_path_is_in_the_users_cache(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_log_path(8123) == tmp_path / "attnquant" / "max-serve-8123.log"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_log_path(1) == Path.home() / ".cache" / "attnquant" / "max-serve-1.log"


def test_log_tail(tmp_path: Path) -> None:
    log = tmp_path / "max.log"
    log.write_text("".join(f"line {i}\n" for i in range(100)))
    assert log_tail(log, 3) == ["line 97", "line 98", "line 99"]
    assert log_tail(tmp_path / "missing.log") == []


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_follower_feeds_the_log_and_says_ready_when_healthy(tmp_path: Path) -> None:
    log = tmp_path / "max.log"
    log.write_text("09:00:00.000 INFO: attnquant: first\n09:00:00.000 INFO: attnquant: sec")
    said: list[str] = []
    report = StartupReport(said.append)
    server = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/health"
        follower = LogFollower(log, report, url, "ready to serve")
        follower.start()
        deadline = time.monotonic() + 30
        while not report.is_ready and time.monotonic() < deadline:
            time.sleep(0.05)
        with open(log, "a") as sink:
            sink.write("ond\n")  # a line finished after the first read
        follower.stop()
    finally:
        server.shutdown()
        server.server_close()
    assert said[0] == "attnquant: first"
    assert said[1].startswith("attnquant: ready to serve in ")
    assert said[2:] == ["attnquant: second"]
    assert not follower.is_alive()


def test_follower_without_a_server_only_ticks(tmp_path: Path) -> None:
    said: list[str] = []
    report = StartupReport(said.append, every_s=0.0)
    follower = LogFollower(tmp_path / "not-yet.log", report, "http://127.0.0.1:9/health", "x")
    follower.start()
    time.sleep(0.3)
    follower.stop()
    assert not report.is_ready
    assert said and all(line.startswith("attnquant: starting MAX, ") for line in said)


def test_quiet_max_logging_in_process(caplog: pytest.LogCaptureFixture) -> None:
    said: list[str] = []
    report = StartupReport(said.append, shown=[PLAN])
    stock = logging.getLogger("max.pipelines")
    ours = logging.getLogger("attnquant_max._plan")
    with caplog.at_level(logging.INFO):
        with quiet_max_logging(report):
            stock.info("devices: cpu[-1]")
            stock.info("Building, compiling, and initializing model...")
            stock.warning("something MAX warns of")
            ours.info(PLAN)  # printed already by the command
            ours.info("attnquant: the decoder holds 12 MiB")
            ours.info("attnquant: the decoder holds 12 MiB")
        stock.info("after the block")
    assert caplog.messages == [
        "something MAX warns of",
        "attnquant: the decoder holds 12 MiB",
        "after the block",
    ]
    assert said == [
        "attnquant: MAX is building and compiling the model graph (minutes on a first start; "
        "seconds when MAX has it cached)"
    ]
    assert logging.getLogger("max").propagate and logging.getLogger("attnquant_max").propagate


def test_progress_ticks_tick() -> None:
    said: list[str] = []
    report = StartupReport(said.append, every_s=0.0)
    with progress_ticks(report, every_s=0.01):
        time.sleep(0.2)
    count = len(said)
    time.sleep(0.05)
    assert count >= 2 and len(said) == count  # stopped with the block


def test_quiet_max_logging_reads_max_info_whatever_the_roots_level() -> None:
    said: list[str] = []
    report = StartupReport(said.append)
    stock = logging.getLogger("max")
    before = stock.level
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.WARNING)
    try:
        with quiet_max_logging(report):
            logging.getLogger("max.pipelines").info(
                "Building, compiling, and initializing sampler took 2.0 seconds"
            )
    finally:
        root.setLevel(level)
    assert said == ["attnquant: the sampler graph built, compiled and initialized in 2.0 s"]
    assert stock.level == before


def test_the_ready_line_names_maxs_cache_where_xdg_puts_it(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    report, said, _ = _report()
    report.ready("model loaded")
    assert f"in its cache ({tmp_path / 'modular'}): " in said[-1]
