"""Cost of checking tensor digests at load, as a ratio to the same load without the check.

Two checkpoints, each read whole the way serving reads it, with ``ATTNQUANT_VERIFY_DIGESTS``
on and off, interleaved, page cache warm (so the figure is the hashing, not the disk):

* ``demo``: the embedded demo model decomposed at passthrough (G=layers, r=0), loaded with
  ``ThetaCheckpoint.open(...).rebuilt_state()`` (what ``serve``, ``verify`` and ``bench`` do);
* ``synthetic``: a ~1 GiB float32 dense checkpoint written by attnquant's writer (so it has
  digests), every tensor read with ``SafetensorsFiles.get``.

Also times ``check_checkpoint`` (what ``attnquant check`` and ``serve``'s up-front check do).

Run: ``uv run --all-packages python benchmarks/bench_digest.py --out digest.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from attnquant_cli import demo_model_path
from attnquant_core import ThetaCheckpoint, check_checkpoint, decompose_checkpoint
from attnquant_core.io import PlannedWriter, TensorSpec, read_tensor_directory

ENV = "ATTNQUANT_VERIFY_DIGESTS"


def load_theta(path: Path) -> Callable[[], int]:
    def run() -> int:
        return sum(a.nbytes for _, a in ThetaCheckpoint.open(path).rebuilt_state())

    return run


def load_dense(path: Path) -> Callable[[], int]:
    def run() -> int:
        files, _ = read_tensor_directory(path)
        return sum(files.get(k).nbytes for k in files.keys())

    return run


def write_synthetic(path: Path, gib: float) -> None:
    """A dense float32 checkpoint of ``gib`` GiB in 64 MiB tensors, written with digests."""
    shape = (4096, 4096)
    count = max(1, round(gib * 2**30 / (4 * shape[0] * shape[1])))
    specs = {f"t.{i}.weight": TensorSpec(np.dtype(np.float32), shape) for i in range(count)}
    path.mkdir(parents=True)
    rng = np.random.default_rng(0)
    block = rng.standard_normal(shape, dtype=np.float32)
    with PlannedWriter(path, specs) as writer:
        for i, key in enumerate(specs):
            writer.write(key, block + np.float32(i))


def timed(run: Callable[[], int], verify: bool) -> float:
    os.environ[ENV] = "1" if verify else "0"
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def measure(name: str, run: Callable[[], int], path: Path, repeats: int) -> dict:
    timed(run, False)  # warm the page cache
    on, off = [], []
    for i in range(repeats):  # alternate which goes first
        for verify in (True, False) if i % 2 == 0 else (False, True):
            (on if verify else off).append(timed(run, verify))
    start = time.perf_counter()
    report = check_checkpoint(path)
    check_s = time.perf_counter() - start
    assert report.ok, report.bad
    result = {
        "checkpoint": name,
        "bytes": report.nbytes,
        "tensors": report.checked,
        "load_s_without_check": statistics.median(off),
        "load_s_with_check": statistics.median(on),
        "ratio": statistics.median(on) / statistics.median(off),
        "check_command_s": check_s,
        "check_command_gb_s": report.nbytes / check_s / 1e9,
        "runs_with": on,
        "runs_without": off,
    }
    print(
        f"{name:10s} {report.nbytes / 2**20:8.1f} MiB  load {result['load_s_without_check']:.3f} s"
        f" -> {result['load_s_with_check']:.3f} s with digests (x{result['ratio']:.2f}); "
        f"attnquant check {check_s:.3f} s ({result['check_command_gb_s']:.2f} GB/s)"
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="Size of the synthetic checkpoint.")
    parser.add_argument("--repeats", type=int, default=5, help="Timed loads of each kind.")
    parser.add_argument("--out", type=Path, help="Write the results as JSON here.")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        theta = Path(tmp) / "demo-theta"
        decompose_checkpoint(demo_model_path(), theta, blocks="layers", rank=0)
        results = [measure("demo", load_theta(theta), theta, args.repeats)]
        synthetic = Path(tmp) / "synthetic"
        write_synthetic(synthetic, args.gib)
        results.append(measure("synthetic", load_dense(synthetic), synthetic, args.repeats))
    if args.out:
        args.out.write_text(json.dumps({"results": results}, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
