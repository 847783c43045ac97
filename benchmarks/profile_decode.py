"""Where a batch-1 decode step's time goes: ``perf`` samples of one served variant, bucketed.

One row of ``bench_compressed.py`` (``--variant``, same checkpoints and options) is loaded,
warmed up, then decodes ``--new-tokens`` greedy tokens after a short prompt ``--runs`` times
while ``perf record`` samples the process at ``--frequency`` Hz (every thread). The samples are
bucketed by the symbol and library they fall in:

* ``kernels``: the compiled model (MAX's kernels and attnquant-kernels' ops run from JIT
  memory, without symbol names, so they are not told apart here), or llama.cpp's ``ggml_``
  compute functions;
* ``runtime``: the runtime between kernels: its worker threads waiting for the next dispatch
  (``clock_gettime`` spins, ``futex``, ``sched_yield``, ggml's barrier), its libraries, the OS;
* ``python``: the interpreter, MAX's Python bindings and numpy (sampling, scheduling);
* ``other``: anything else (libc's allocator, the loader).

The samples fall on every thread that runs, so a bucket's share is a share of the CPU time the
process spends (``/proc/PID/stat`` over the same window, both cores counted), and its share
times that CPU time per token says how many CPU-milliseconds of each token it holds; beside it,
the wall time a token takes.

Run: ``uv run python benchmarks/profile_decode.py --shape 300m --variant "nvfp4+head"
--work DIR`` (needs ``perf``; ``perf_event_paranoid`` <= 2 is enough for one's own process).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: (bucket, library pattern, symbol pattern): the first that matches a sample's library or
#: symbol takes it. MAX's compiled kernels run from JIT memory (``[JIT] tid N``) with no symbol
#: names, beside Mojo's compiler runtime library; llama-server is one static binary whose
#: ``ggml_`` symbols are named, its OpenMP threads' barrier spin (libgomp) counted as runtime.
BUCKETS = (
    ("runtime", r"^\[vdso\]|kallsyms|AsyncRT|libmax\.so|libMGPRT|libstdc\+\+|libgcc|libgomp",
     r"clock_gettime|futex|sched_yield|ggml_barrier|pthread|chrono"),
    ("kernels", r"^\[JIT\]|KGENCompilerRT", r"^ggml_|quantize_row|dequantize_row|^mul_mat"),
    ("python", r"python|_core\.cpython|_multiarray|_kv_core", r"^_?Py"),
)  # fmt: skip


def bucket(dso: str, symbol: str) -> str:
    """The bucket of one sample's library and symbol (symbol rules first)."""
    for name, _, sym in BUCKETS:
        if re.search(sym, symbol):
            return name
    for name, lib, _ in BUCKETS:
        if re.search(lib, dso):
            return name
    return "other"


def report(data: Path) -> list[tuple[float, str, str]]:
    """``perf report``'s flat profile: (percent of samples, library, symbol), self time."""
    out = subprocess.run(
        [
            "perf",
            "report",
            "-i",
            str(data),
            "--no-children",
            "--stdio",
            "--sort",
            "dso,sym",
            "-g",
            "none",
            "--field-separator",
            "|",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = []
    for line in out.splitlines():
        parts = line.split("|")
        if len(parts) == 3 and parts[0].strip().endswith("%"):
            symbol = re.sub(r"^\[[.k]\]\s*", "", parts[2].strip())
            rows.append((float(parts[0].strip()[:-1]), parts[1].strip(), symbol))
    return rows


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of process ``pid`` and its threads so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    import bench_compressed as bc
    from synthetic_llama import SHAPES, cached_synthetic

    from attnquant_cli._bench import prompt_ids

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="300m")
    parser.add_argument("--variant", default="nvfp4+head", help="a bench_compressed row, or base")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--frequency", type=int, default=1999)
    parser.add_argument("--work", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    work = args.work or Path(tempfile.mkdtemp(prefix="aq-profile-"))
    base_dir = cached_synthetic(work, shape)
    common = {"max_length": 128 + args.new_tokens, "max_batch_size": 1}
    if args.variant == "base":
        path, overrides, how = base_dir, {}, "float32, stock graph"
    else:
        path, overrides, how = bc.prepare(args.variant, base_dir, work, shape)
    loaded, how = bc.load_variant(args.variant, path, overrides, how, common)
    run = bc.runner_of(loaded)
    prompt = prompt_ids(lambda t: list(range(3, 3 + len(t) // 4)), 32)
    for _ in range(2):
        run(prompt, args.new_tokens)
    data = Path(tempfile.mkstemp(suffix=".perf.data")[1])
    target = getattr(getattr(loaded, "server", None), "proc", None)
    pid = target.pid if target is not None else os.getpid()
    perf = subprocess.Popen(
        ["perf", "record", "-F", str(args.frequency), "-o", str(data), "-p", str(pid)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(1.0)
    t0, cpu0 = time.perf_counter(), cpu_seconds(pid)
    for _ in range(args.runs):
        run(prompt, args.new_tokens)
    seconds, cpu = time.perf_counter() - t0, cpu_seconds(pid) - cpu0
    perf.send_signal(2)
    perf.wait()
    loaded.close()
    rows = report(data)
    total = sum(r[0] for r in rows) or 1.0
    tokens = args.runs * args.new_tokens
    per_token_ms, cpu_ms = seconds / tokens * 1e3, cpu / tokens * 1e3
    shares = collections.Counter()
    for pct, dso, sym in rows:
        shares[bucket(dso, sym)] += pct / total
    print(f"{args.variant} ({how}) at {args.shape}: {per_token_ms:.2f} ms a token, "
          f"{cpu_ms:.2f} CPU-ms a token on all cores (prompt 32 included, {args.runs} x "
          f"{args.new_tokens} tokens)")  # fmt: skip
    for name, share in shares.most_common():
        print(f"  {name:<14} {100 * share:5.1f}%  {share * cpu_ms:6.2f} CPU-ms a token")
    print("  top symbols:")
    for pct, dso, sym in sorted(rows, reverse=True)[:15]:
        print(f"    {100 * pct / total:5.1f}%  {dso[:28]:<28} {sym[:90]}")
    if args.out:
        result = {"variant": args.variant, "served": how, "shape": args.shape,
                  "per_token_ms": per_token_ms, "cpu_ms_per_token": cpu_ms,
                  "shares": dict(shares),
                  "top": sorted(rows, reverse=True)[:40]}  # fmt: skip
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
