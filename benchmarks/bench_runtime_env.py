"""One variant's decode alone, once per setting of MAX's CPU runtime, each in a fresh process.

MAX 26.7 reads a few ``MODULAR_*`` variables when its CPU runtime starts (found in its
libraries' strings: ``MODULAR_ENABLE_AFFINITY``, ``MODULAR_THREAD_BUSY_WAIT_US``). Whether they
move decode is measured here rather than assumed: for each ``--env`` setting (``""`` for none)
a child process loads the variant (``bench_compressed.prepare`` / ``load_variant``, nothing else
resident), warms up, and times ``--runs`` generations of ``--new-tokens`` after a
``--prompt-tokens`` prompt as ``attnquant bench`` does. A child that dies is reported with the
last line it printed (a setting MAX refuses is a finding too). Settings run one after another
in the order given, ``--rounds`` times, every other round in the reverse order (ABBA); run it on
an otherwise idle machine. A serving option's ``ATTNQUANT_*`` variable in a setting is laid over
the variant's options (``ATTNQUANT_WORKER_NICE=0``: MAX's workers left at their priority).

Run: ``python benchmarks/bench_runtime_env.py --shape 300m --work DIR --env "" \\
MODULAR_ENABLE_AFFINITY=1 MODULAR_THREAD_BUSY_WAIT_US=0``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def child(args: argparse.Namespace) -> None:
    """Load, warm up, time; print one JSON line."""
    from bench_compressed import load_variant, prepare
    from synthetic_llama import SHAPES, cached_synthetic

    from attnquant_cli._bench import generate_runner, measure, prompt_ids
    from attnquant_core.serving import OPTIONS, ServingOptions

    shape = SHAPES[args.shape]
    base_dir = cached_synthetic(args.work, shape)
    path, overrides, how = prepare(args.variant, base_dir, args.work, shape, None)
    from_env = ServingOptions.from_env()
    given = {s.field: getattr(from_env, s.field) for s in OPTIONS if os.environ.get(s.variable)}
    overrides = {**overrides, **given}
    common = {"max_length": args.prompt_tokens + args.new_tokens + 8, "max_batch_size": 8}
    loaded, how = load_variant(args.variant, path, overrides, how, common)
    run = generate_runner(loaded)
    prompt = prompt_ids(loaded.encode, args.prompt_tokens)
    measure(run, prompt, 8)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    samples = [measure(run, prompt, args.new_tokens) for _ in range(args.runs)]
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    decode = [s.decode_tok_s for s in samples]
    print(
        json.dumps(
            {
                "served": how,
                "decode_tok_s": decode,
                "median_decode_tok_s": statistics.median(decode),
                "median_prefill_tok_s": statistics.median(s.prefill_tok_s for s in samples),
                "cpu_s_per_wall_s": cpu / wall,
            }
        ),
        flush=True,
    )
    loaded.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="300m")
    parser.add_argument("--variant", default="nvfp4+head")
    parser.add_argument("--work", type=Path, required=True, help="checkpoints (kept)")
    parser.add_argument("--env", nargs="+", default=[""], help="'K=V[,K=V]' per run; '' none")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1, help="ABBA rounds over the settings")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.child:
        child(args)
        return
    rows = []
    order = [
        setting for r in range(args.rounds) for setting in args.env[:: 1 if r % 2 == 0 else -1]
    ]
    for setting in order:
        extra = dict(kv.split("=", 1) for kv in setting.split(",") if kv)
        cmd = [sys.executable, __file__, "--child", *sys.argv[1:]]
        done = subprocess.run(
            cmd, env={**os.environ, **extra}, capture_output=True, text=True, check=False
        )
        lines = (done.stdout + done.stderr).strip().splitlines() or ["(nothing printed)"]
        row: dict = {"setting": setting, "env": extra, "exit_code": done.returncode}
        if done.returncode == 0:
            row.update(json.loads(done.stdout.strip().splitlines()[-1]))
            said = (
                f"decode {row['median_decode_tok_s']:.1f} tok/s "
                f"({', '.join(f'{d:.1f}' for d in row['decode_tok_s'])}); prefill "
                f"{row['median_prefill_tok_s']:.0f} tok/s; {row['cpu_s_per_wall_s']:.2f} CPU-s/s"
            )
        else:
            row["last_line"] = lines[-1]
            said = f"exit {done.returncode}: {lines[-1]}"
        rows.append(row)
        print(f"{setting or '(none)'}: {said}", flush=True)
    for setting in args.env if args.rounds > 1 else []:
        ran = [r for r in rows if r["setting"] == setting and "served" in r]
        if ran:
            decode = statistics.median(r["median_decode_tok_s"] for r in ran)
            prefill = statistics.median(r["median_prefill_tok_s"] for r in ran)
            print(
                f"{setting or '(none)'} over {len(ran)} processes: decode {decode:.1f} tok/s, "
                f"prefill {prefill:.0f} tok/s"
            )
    if args.out:
        args.out.write_text(json.dumps({"variant": args.variant, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
