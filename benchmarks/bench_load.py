"""Load on ``attnquant serve``: many concurrent clients for a while, hostile requests mixed in.

Starts ``attnquant serve`` (the demo model by default; ``--env NAME=VALUE`` picks the serving
path) on a free loopback port, waits until it answers, then ``--clients`` threads send requests
(one connection each) for ``--seconds``. The valid ones rotate through what clients send: a
completion (``--max-tokens``), lm-eval's log-likelihood request (token ids, ``echo``,
``logprobs``, ``max_tokens: 0``), a completion with a stop sequence, ``n: 2``, a chat. Every
``--malformed-every``-th request is malformed or hostile (bad JSON, wrong types, token ids
outside the vocabulary, a seed past 2**64, ``logit_bias``, deep nesting, invalid UTF-8: several
of these took MAX's own server down) and must get a 4xx. Reports statuses by kind, errors
(5xx on a valid request, a dropped connection, a wrong status), latency p50/p99 of the valid
requests, then stops the server with SIGTERM and checks that it exits 0 and leaves no process.

Run: ``uv run --all-packages python benchmarks/bench_load.py --out load.json``
(64 clients, 600 s by default).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _servers import wait_healthy

MALFORMED: tuple[tuple[str, bytes], ...] = (
    ("/v1/completions", b"{not json"),
    ("/v1/completions", b'{"prompt": "def "}'),
    ("/v1/completions", b'{"model": "m", "prompt": "def ", "max_tokens": -3}'),
    ("/v1/completions", b'{"model": "m", "prompt": 17}'),
    ("/v1/chat/completions", b'{"model": "m", "messages": "not a list"}'),
    ("/v1/nowhere", b"{}"),
    ("/v1/completions", b'{"model": "m", "prompt": [5, 999999], "max_tokens": 1}'),
    ("/v1/completions", b'{"model": "m", "prompt": [-1], "echo": true, "logprobs": 1}'),
    ("/v1/completions", b'{"model": "m", "prompt": "x", "seed": 99999999999999999999}'),
    ("/v1/completions", b'{"model": "m", "prompt": "x", "logit_bias": {"5": 100}}'),
    ("/v1/completions", b'{"model": "m", "prompt": "x", "temperature": NaN}'),
    ("/v1/completions", b'{"model": "m", "prompt": "x", "echo": true, "stream": true}'),
    ("/v1/completions", b"[" * 100_000),
    ("/v1/completions", b'{"model": "m", "prompt": "\xff\xfe"}'),
    ("/v1/chat/completions", b'{"model": "m", "messages": [{"role": "x", "content": 1}]}'),
)


def post(port: int, path: str, body: bytes) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def descendants(pid: int) -> set[int]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                tree.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pids: set[int]) -> set[int]:
    left = set()
    for pid in pids:
        try:
            if (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "Z":
                left.add(pid)
        except OSError:
            pass
    return left


def run_load(port: int, model: str, args: argparse.Namespace) -> dict:
    latencies: list[float] = []
    statuses: dict[str, int] = {}
    errors: list[str] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + args.seconds
    greedy = {"model": model, "max_tokens": args.max_tokens, "temperature": 0.0}
    valid = {
        "completion": ("/v1/completions", {**greedy, "prompt": "def "}),
        "loglikelihood": ("/v1/completions", {"model": model, "prompt": [[312, 45, 1200, 7, 88]],
                                              "max_tokens": 0, "echo": True, "logprobs": 1}),
        "stop": ("/v1/completions", {**greedy, "prompt": "import ", "stop": ["\n"]}),
        "n=2": ("/v1/completions", {**greedy, "prompt": "class ", "n": 2}),
        "chat": ("/v1/chat/completions", {**greedy, "messages": [{"role": "user", "content": "hi"}]}),
    }  # fmt: skip
    valid_bodies = [(kind, path, json.dumps(body).encode()) for kind, (path, body) in valid.items()]

    def client(index: int) -> None:
        n = index
        while time.monotonic() < stop_at:
            n += 1
            bad = args.malformed_every and n % args.malformed_every == 0
            kind, path, body = (
                ("malformed", *MALFORMED[n // args.malformed_every % len(MALFORMED)])
                if bad
                else valid_bodies[n % len(valid_bodies)]
            )
            start = time.perf_counter()
            try:
                status = post(port, path, body)
            except OSError as exc:
                with lock:
                    errors.append(f"{type(exc).__name__}: {exc}")
                continue
            elapsed = time.perf_counter() - start
            with lock:
                statuses[f"{kind} {status}"] = statuses.get(f"{kind} {status}", 0) + 1
                if not bad and status == 200:
                    latencies.append(elapsed)
                elif (bad and not 400 <= status < 500) or (not bad and status != 200):
                    errors.append(f"{kind}: HTTP {status}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    q = statistics.quantiles(latencies, n=100) if len(latencies) > 1 else [float("nan")] * 99
    return {
        "completions": len(latencies),
        "requests": sum(statuses.values()) + len(errors),
        "errors": len(errors),
        "error_examples": errors[:10],
        "statuses": statuses,
        "p50_s": statistics.median(latencies) if latencies else None,
        "p99_s": q[98],
        "completions_per_s": len(latencies) / args.seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="demo", help="Checkpoint to serve.")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--malformed-every", type=int, default=8, help="0: none malformed.")
    parser.add_argument("--ready-timeout", type=float, default=1200.0)
    parser.add_argument("--out", type=Path, help="Write the results as JSON here.")
    parser.add_argument(
        "--env", action="append", default=[], help="NAME=VALUE for the server (the path)."
    )
    args = parser.parse_args()
    env = dict(os.environ, **dict(item.split("=", 1) for item in args.env))
    from attnquant_max.gateway import free_port

    port = free_port()
    log = Path(tempfile.mkstemp(prefix="bench-load-", suffix=".log")[1])
    argv = [sys.executable, "-m", "attnquant_cli", "serve", args.model, "--port", str(port)]
    argv += ["--served-model-name", "m"]
    with open(log, "wb") as sink:
        proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, env=env)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", log, args.ready_timeout)
        tree = descendants(proc.pid)
        result = run_load(port, "m", args)
        result["answers_after"] = post(
            port,
            "/v1/completions",
            json.dumps({"model": "m", "prompt": "x", "max_tokens": 2}).encode(),
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        result_code = proc.wait(timeout=120)
    deadline = time.monotonic() + 60
    while alive(tree) and time.monotonic() < deadline:
        time.sleep(0.5)
    result.update(
        clients=args.clients,
        seconds=args.seconds,
        max_tokens=args.max_tokens,
        malformed_every=args.malformed_every,
        env=args.env,
        path_line=next(
            (
                line
                for line in log.read_text(errors="replace").splitlines()
                if "attnquant: " in line
            ),
            "",
        ),
        exit_code_after_sigterm=result_code,
        processes_left=sorted(alive(tree)),
        stopped_cleanly="server stopped" in log.read_text(errors="replace"),
    )
    print(json.dumps({k: v for k, v in result.items() if k != "error_examples"}, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
