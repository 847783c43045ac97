"""What the serving benchmarks share: a server process waited on until it answers."""

from __future__ import annotations

import subprocess
import time
import urllib.request
from pathlib import Path


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout_s: float = 1800) -> None:
    """Return once ``url``/health answers 200; exit naming ``log`` if the server dies or is not
    ready within ``timeout_s`` (a cold graph compile takes minutes on 2 cores)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args[0]} exited with {proc.returncode}; see {log}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(2)
    proc.kill()
    raise SystemExit(f"server not ready in {timeout_s:.0f} s; see {log}")
