"""Many streams at once: ``attnquant serve`` against ``llama-server``, aggregate tokens per second.

What an operator sees with concurrent clients: ``--streams`` (8 and 32) completions sent at
once, each a distinct prompt of about ``--prompt-tokens`` tokens and ``--tokens`` greedy new
tokens (``ignore_eos``), and the aggregate rate: every stream's new tokens over the wall time
from the first request sent to the last response done. Both servers run side by side, each
with room for the most streams asked (``attnquant serve --max-batch-size N``: MAX batches the streams
into one forward; ``llama-server -np N``: one slot a stream, continuously batched), and are
timed in ABBA pairs (:func:`attnquant_core.run_paired`, ``--settle`` idle seconds before each
run so neither server's spinning threads slow the other's): attnquant / llama.cpp as the geometric
mean of within-pair ratios with a bootstrap 95% interval, beside the machine's load.

The model is the synthetic Llama of ``synthetic_llama.py`` (``--shape``), or a real Llama
checkpoint (``--model DIR``, e.g. one ``attnquant import`` wrote), served by attnquant
as ``--aq-args`` say (default: NVFP4 with its head and embedding table, attnquant's fastest
4-bit decode, at fewer bytes than Q4_K_M) and by llama.cpp as its own ``llama-quantize`` made it
(``--llamacpp``, default Q4_K_M).

Run: ``uv run --all-packages --group bench python benchmarks/bench_streams.py --shape 300m
--out streams.json`` (llama.cpp built first: ``python benchmarks/llamacpp.py build``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))
import llamacpp
from _servers import wait_healthy

NAME = "m"


def start_attnquant(model: Path, streams: int, max_length: int, args: list[str], log: Path):
    """``attnquant serve`` of ``model`` with room for ``streams`` requests in one batch."""
    from attnquant_max.gateway import free_port

    port = free_port()
    argv = [sys.executable, "-m", "attnquant_cli", "serve", str(model), "--port", str(port),
            "--served-model-name", NAME, "--max-batch-size", str(streams),
            "--max-length", str(max_length), "--no-echo", *args]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, log)
    return proc, url


def prompts(n: int, words: int) -> list[str]:
    """``n`` distinct prompts (no shared prefix for a prompt cache to reuse)."""
    from attnquant_cli._bench import BENCH_TEXT

    text = (BENCH_TEXT * 8).split(" ")
    return [f"# stream {i}\n" + " ".join(text[i : i + words]) for i in range(n)]


def burst(client: httpx.Client, url: str, texts: list[str], tokens: int) -> dict[str, float]:
    """All of ``texts`` at once through ``/v1/completions``; aggregate new tokens per second."""

    def one(text: str) -> tuple[float, int, int]:
        body = {"model": NAME, "prompt": text, "max_tokens": tokens, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        r = client.post(f"{url}/v1/completions", json=body)
        r.raise_for_status()
        usage = r.json()["usage"]
        return time.perf_counter(), usage["completion_tokens"], usage["prompt_tokens"]

    start = time.perf_counter()
    with ThreadPoolExecutor(len(texts)) as pool:
        done = list(pool.map(one, texts))
    wall = max(d[0] for d in done) - start
    new = sum(d[1] for d in done)
    if new != tokens * len(texts):
        raise RuntimeError(f"{url}: {new} tokens for {len(texts)} x {tokens}")
    return {"tok_s": new / wall, "wall_s": wall, "prompt_tokens": sum(d[2] for d in done)}


def measure(client: httpx.Client, aq_url: str, lcpp_url: str, n: int, args: Any) -> dict:
    """``n`` streams at once on each server, ``args.pairs`` ABBA pairs; the row, printed."""
    from attnquant_core import machine_load, paired_ratio, read_load, run_paired

    texts = prompts(n, args.prompt_words)
    before = read_load()
    runs = run_paired(
        lambda: burst(client, aq_url, texts, args.tokens),
        lambda: burst(client, lcpp_url, texts, args.tokens),
        pairs=args.pairs,
        warmup=1,
        settle=args.settle,
    )
    load = machine_load(before)
    ratio = paired_ratio([r["tok_s"] for r in runs.a], [r["tok_s"] for r in runs.b])
    row = {
        "ratio": ratio.to_json(),
        "attnquant_tok_s": [r["tok_s"] for r in runs.a],
        "llamacpp_tok_s": [r["tok_s"] for r in runs.b],
        "prompt_tokens": {
            "attnquant": runs.a[0]["prompt_tokens"],
            "llamacpp": runs.b[0]["prompt_tokens"],
        },
        "load": load.to_json(),
    }
    med = {k: sorted(row[k])[len(row[k]) // 2] for k in ("attnquant_tok_s", "llamacpp_tok_s")}
    print(
        f"{n} streams: attnquant / llama.cpp {ratio.ratio:.3f} [{ratio.low:.3f}, "
        f"{ratio.high:.3f}]; {med['attnquant_tok_s']:.1f} against "
        f"{med['llamacpp_tok_s']:.1f} tok/s aggregate; prompt tokens "
        f"{row['prompt_tokens']}; {load.describe()}",
        flush=True,
    )
    return row


def main() -> None:
    from synthetic_llama import SHAPES, cached_synthetic

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="300m")
    parser.add_argument(
        "--model",
        type=Path,
        help="a Hugging Face Llama checkpoint (a real model, e.g. one `attnquant import` made) "
        "in place of the synthetic --shape",
    )
    parser.add_argument("--streams", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=40, help="words of each prompt")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument(
        "--settle",
        type=float,
        default=0.5,
        help="seconds idle before each timed run, so the other side's spinning threads stop",
    )
    parser.add_argument(
        "--aq-args", default="--quant nvfp4 --quant-head --quant-embedding --nvfp4-kernel fused"
    )
    parser.add_argument("--llamacpp", default="Q4_K_M", help="llama-quantize type, or F32")
    parser.add_argument("--work", type=Path, help="keep the checkpoints here")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("MAX_SERVE_DISABLE_TELEMETRY", "1")
    work = args.work or Path(tempfile.mkdtemp(prefix="aq-bench-streams-"))
    model = args.model.resolve() if args.model else cached_synthetic(work, SHAPES[args.shape])
    gguf = llamacpp.cached_gguf(model, work / "llamacpp", args.llamacpp)
    threads = os.cpu_count() or 1
    results: dict[str, object] = {"shape": model.name if args.model else args.shape, "tokens": args.tokens,
                                  "aq_args": args.aq_args, "llamacpp": args.llamacpp,
                                  "streams": {}}  # fmt: skip
    max_length = 2 * args.prompt_words + args.tokens + 64
    capacity = max(args.streams)
    aq = lcpp = None
    try:
        aq = start_attnquant(model, capacity, max_length, shlex.split(args.aq_args),
                             work / "attnquant.log")  # fmt: skip
        lcpp = llamacpp.LlamaServer(gguf, threads=threads, ctx=max_length, parallel=capacity)
        with httpx.Client(timeout=1800) as client:
            for n in args.streams:
                results["streams"][str(n)] = measure(client, aq[1], lcpp.url, n, args)
                args.out.write_text(json.dumps(results, indent=2) + "\n")
    finally:
        if aq is not None:
            os.killpg(aq[0].pid, signal.SIGINT)
            aq[0].wait(timeout=60)
        if lcpp is not None:
            lcpp.close()
    args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
