"""Measure a cold CI run: every default nox session with an empty MAX cache, and every graph built.

    python scripts/cold_ci.py                  # all default sessions, MAX cache cold
    python scripts/cold_ci.py --cold-uv        # the uv cache cold too (downloads every wheel)
    python scripts/cold_ci.py -s tests-max     # some sessions only
    python scripts/cold_ci.py --warm           # keep ~/.cache/modular: the warm-run time
    python scripts/cold_ci.py --keep-cache     # cold, then keep the caches it filled, and
    XDG_CACHE_HOME=<printed> python scripts/cold_ci.py --warm   # time CI again on them

MAX compiles a graph on first use and caches it under ``$XDG_CACHE_HOME/modular``; this points
``XDG_CACHE_HOME`` at a fresh temporary directory (uv's cache stays where it is unless
``--cold-uv``), runs each session as ``.ci/run`` does (``uv run nox -s SESSION``), and reads the
log that the root ``conftest.py`` writes when ``ATTNQUANT_COMPILE_LOG`` is set: per test, the
graphs that appeared in MAX's cache while it ran. It prints the time of each session and one row
per test that compiled, and writes both as JSON (``--out``). Run it on an otherwise idle machine:
compile times scale with the free cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SESSIONS = ["lint", "tests-core", "tests-kernels", "tests-max", "tests-cli"]
DEFAULT_SESSIONS += ["integration", "build"]


def _uv_cache_dir() -> str:
    done = subprocess.run(["uv", "cache", "dir"], capture_output=True, text=True, check=True)
    return done.stdout.strip()


def run_sessions(sessions: list[str], env: dict[str, str], log_dir: Path) -> list[dict]:
    """``uv run nox -s SESSION`` for each, in order; the wall time and exit code of each."""
    rows = []
    for session in sessions:
        start = time.monotonic()
        with open(log_dir / f"{session}.log", "wb") as sink:
            code = subprocess.run(
                ["uv", "run", "nox", "-s", session],
                cwd=ROOT,
                env={**env, "ATTNQUANT_CI_SESSION": session},
                stdout=sink,
                stderr=subprocess.STDOUT,
                check=False,
            ).returncode
        seconds = time.monotonic() - start
        rows.append({"session": session, "seconds": round(seconds, 1), "exit_code": code})
        print(f"{session:<14} {seconds / 60:6.1f} min  exit {code}", flush=True)
    return rows


def read_compiles(log: Path) -> list[dict]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-s", "--sessions", nargs="+", default=DEFAULT_SESSIONS)
    parser.add_argument("--cold-uv", action="store_true", help="Empty uv cache as well.")
    parser.add_argument("--warm", action="store_true", help="Use the user's MAX cache as is.")
    parser.add_argument(
        "--keep-cache", action="store_true", help="Keep the caches filled (for a --warm rerun)."
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results" / "cold_ci.json")
    args = parser.parse_args(argv)

    scratch = Path(tempfile.mkdtemp(prefix="attnquant-cold-ci-"))
    env = dict(os.environ)
    compile_log = scratch / "compiles.jsonl"
    env["ATTNQUANT_COMPILE_LOG"] = str(compile_log)
    if not args.warm:
        if not args.cold_uv:
            env["UV_CACHE_DIR"] = env.get("UV_CACHE_DIR") or _uv_cache_dir()
        env["XDG_CACHE_HOME"] = str(scratch / "cache")
    print(f"logs in {scratch}; MAX cache {'warm' if args.warm else 'cold'}", flush=True)
    start = time.monotonic()
    sessions = run_sessions(args.sessions, env, scratch)
    total = time.monotonic() - start
    compiles = read_compiles(compile_log)

    # Under pytest-xdist two tests run at once, so a graph can appear under both: count each
    # cache entry once.
    graphs = {name for c in compiles for name in c["names"]}
    print(f"\n{'total':<14} {total / 60:6.1f} min")
    print(f"\n{len(graphs)} graphs compiled (tests by wall time, setup and teardown included):")
    for c in sorted(compiles, key=lambda c: -c["seconds"]):
        where = f"{c['session']} {c.get('worker', '')}".strip()
        print(f"  {c['graphs']} graph(s) {c['seconds']:7.1f} s  [{where}] {c['test']}")
    result = {
        "cold_max_cache": not args.warm,
        "cold_uv_cache": args.cold_uv,
        "total_seconds": round(total, 1),
        "sessions": sessions,
        "graphs": len(graphs),
        "compiles": compiles,
        "cpus": os.cpu_count(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    if args.keep_cache and not args.warm:
        print(f"caches kept: XDG_CACHE_HOME={scratch / 'cache'}")
    elif not args.warm:
        shutil.rmtree(scratch / "cache", ignore_errors=True)
    return 0 if all(s["exit_code"] == 0 for s in sessions) else 1


if __name__ == "__main__":
    sys.exit(main())
