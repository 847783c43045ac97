"""What serving through the gateway, and serving prompt log-probabilities, cost a decode.

Four servers of one model run side by side, each on its own loopback port:

* ``max``: ``max serve`` on attnquant's architectures, as ``attnquant serve`` ran it before the
  gateway (prefix caching, chunked prefill and the overlap scheduler on, no echo);
* ``max+echo``: the same with ``--enable-echo`` and prefix caching and chunked prefill off (what
  correct prompt log-probabilities need);
* ``attnquant``: ``attnquant serve`` (the gateway in front of ``max+echo``), the default;
* ``attnquant --no-echo``: the gateway in front of ``max``.

One run streams ``--tokens`` greedy tokens of a fixed prompt (``ignore_eos``) and times the
first token (TTFT) and the rest (decode tok/s, the client's view). Each comparison is timed in
``--pairs`` ABBA pairs against ``max`` (:func:`attnquant_core.run_paired`): the ratio of decode
tok/s and of TTFT with a bootstrap 95% interval, beside the machine's load.

Run: ``uv run --all-packages --group bench python benchmarks/bench_serve.py --out serve.json``
(``--model 300m`` writes and serves the 300M synthetic Llama of ``synthetic_llama.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from _servers import wait_healthy

VARIANTS = ("max+echo", "attnquant", "attnquant --no-echo")
PROMPT = "def main(argv):\n"


def start(variant: str, model: Path, name: str, log: Path) -> tuple[subprocess.Popen, str]:
    """One server of ``variant`` on a free port, returned once ``/health`` answers."""
    from attnquant_max import serve_command, serve_env
    from attnquant_max.gateway import ECHO_SERVE_ARGS, free_port

    port = free_port()
    if variant.startswith("max"):
        extra = ECHO_SERVE_ARGS if variant == "max+echo" else ()
        argv = serve_command(model, port=port, max_length=512, max_batch_size=8,
                             served_model_name=name, extra_args=extra)  # fmt: skip
        env = serve_env()
    else:
        argv = [sys.executable, "-m", "attnquant_cli", "serve", str(model), "--port", str(port),
                "--served-model-name", name, *variant.split()[1:]]  # fmt: skip
        env = dict(os.environ)
    proc = subprocess.Popen(argv, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, log)
    return proc, url


def one_run(client: httpx.Client, url: str, name: str, tokens: int) -> dict[str, float]:
    """Stream ``tokens`` greedy tokens; TTFT and decode tokens per second after the first."""
    body = {"model": name, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    start = time.perf_counter()
    times = []
    with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data:") and '"text"' in line:
                times.append(time.perf_counter())
    if len(times) < 2:
        raise RuntimeError(f"{url}: {len(times)} tokens streamed")
    return {"ttft_s": times[0] - start, "decode_tok_s": (len(times) - 1) / (times[-1] - times[0])}


def main() -> None:
    from attnquant_cli import demo_model_path
    from attnquant_core import machine_load, paired_ratio, read_load, run_paired

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="demo", help="'demo', '300m' or a checkpoint folder")
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("MAX_SERVE_DISABLE_TELEMETRY", "1")
    work = Path(tempfile.mkdtemp(prefix="aq-bench-serve-"))
    if args.model == "demo":
        model = demo_model_path()
    elif args.model == "300m":
        from synthetic_llama import SHAPES, write_synthetic

        model = write_synthetic(work / "300m", SHAPES["300m"], demo_model_path())
    else:
        model = Path(args.model)
    servers = {}
    try:
        for variant in ("max", *VARIANTS):
            servers[variant] = start(variant, model, "m", work / f"{variant.replace(' ', '_')}.log")
        results = {}
        with httpx.Client(timeout=600) as client:
            for variant in VARIANTS:
                before = read_load()
                runs = run_paired(
                    lambda v=variant: one_run(client, servers[v][1], "m", args.tokens),
                    lambda: one_run(client, servers["max"][1], "m", args.tokens),
                    pairs=args.pairs,
                    warmup=1,
                )
                results[variant] = {
                    "decode": paired_ratio(
                        [r["decode_tok_s"] for r in runs.a], [r["decode_tok_s"] for r in runs.b]
                    ).to_json(),
                    "ttft": paired_ratio(
                        [r["ttft_s"] for r in runs.a], [r["ttft_s"] for r in runs.b]
                    ).to_json(),
                    "decode_tok_s": [r["decode_tok_s"] for r in runs.a],
                    "max_decode_tok_s": [r["decode_tok_s"] for r in runs.b],
                    "load": machine_load(before).to_json(),
                }
                d, t = results[variant]["decode"], results[variant]["ttft"]
                print(
                    f"{variant:>22} / max: decode {d['ratio']:.3f} [{d['ci_low']:.3f}, "
                    f"{d['ci_high']:.3f}]  TTFT {t['ratio']:.3f} [{t['ci_low']:.3f}, "
                    f"{t['ci_high']:.3f}]  ({len(runs.a)} pairs)",
                    flush=True,
                )
    finally:
        for proc, _ in servers.values():
            os.killpg(proc.pid, signal.SIGINT)
        for proc, _ in servers.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    report = {"model": args.model, "tokens": args.tokens, "pairs": args.pairs, "results": results}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
