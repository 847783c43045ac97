"""Where a batch-1 decode step's wall time goes, by timers: the graph, the sampler, the Python.

``profile_decode.py`` samples which code the CPUs run; this times the parts of a step from the
outside, so the parts add up to the wall time a token takes. One NVFP4 row of
``bench_compressed.py`` (``--variant``, its checkpoints and options) is loaded and decodes
``--new-tokens`` greedy tokens after a ``--prompt``-token prompt, ``--runs`` times. Two timers
wrap the objects MAX 26.7's ``TextGenerationPipeline`` runs each step:

* the model's compiled graph (``_pipeline_model.model.execute``): embedding, projections,
  norms, attention, head;
* the sampler's compiled graph (``_sampler_without_bitmask``): the next token from the logits.

What is left of the wall time is the pipeline's own Python between them (the batch and its KV
cache inputs, the sampling inputs, the context updates). Each part is a mean per step, as the
wall time is: a step where the driving thread waited for a core (MAX's idle workers spin after a
graph; ``--worker-nice`` lowers them) counts where the wait fell.

Inside the graph, the same step's projections are timed alone: one MAX graph of the model's
NVFP4 ops at its shapes (merged q/k/v and gate/up, the head in NVFP4 where the variant holds it
so), one row, the same kernel options, random codes of the same bytes; and again with the
glue a layer adds around them (two RMSNorms, two residual adds, SiLU times up). The graph's time
less that chain is what attention (RoPE, the KV-cache write, the attention kernel) and the
embedding take. Each run decodes first, then executes both chains as many times, so the parts
are measured in the same minutes. Where llama.cpp is built, ``llama-bench -p 0 -n N -r 1`` on
the Q4_K_M of the same weights runs once a run too, ``--settle`` seconds after MAX's last run
(its idle workers spin for 0.1-0.2 s, and llama-bench run at once decoded at a third of its
rate): its whole step, for scale.

Run: ``uv run python benchmarks/profile_step.py --shape 300m --variant nvfp4+head+emb --work
DIR --out F`` (the chain graphs compile once, about a minute each, cold).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np


class Timer:
    """Wraps ``inner`` and times each ``execute`` (or call) into :attr:`seconds`."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.seconds = inner, []

    def execute(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = self.inner.execute(*args, **kwargs)
        self.seconds.append(time.perf_counter() - t0)
        return out

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = self.inner(*args, **kwargs)
        self.seconds.append(time.perf_counter() - t0)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def wrap_pipeline(loaded: Any) -> tuple[Timer, Timer]:
    """Timers on the loaded pipeline's model graph and sampler graph (MAX 26.7's names)."""
    pipeline = getattr(loaded.model, "pipeline", None)
    model = getattr(pipeline, "_pipeline_model", None)
    if model is None or not hasattr(pipeline, "_sampler_without_bitmask"):
        raise SystemExit("this MAX's text pipeline has no _pipeline_model or sampler to time")
    model.model = graph = Timer(model.model)
    pipeline._sampler_without_bitmask = sampler = Timer(pipeline._sampler_without_bitmask)
    return graph, sampler


def chain_shapes(shape: Any, head: bool) -> list[tuple[int, int]]:
    """(out, in) of one decode step's NVFP4 ops, in order: per layer q/k/v merged, o,
    gate/up merged, down; then the head where it is NVFP4."""
    head_dim = shape.hidden // shape.heads
    qkv = (shape.heads + 2 * shape.kv_heads) * head_dim
    h, f = shape.hidden, shape.intermediate
    layer = [(qkv, h), (h, shape.heads * head_dim), (2 * f, h), (h, f)]
    return layer * shape.layers + ([(shape.vocab, h)] if head else [])


def chain_model(
    shape: Any, *, head: bool, glue: bool, activations: str, rows: int = 1
) -> tuple[Any, list]:
    """The step's projections (``glue``: with the norms, residual adds and SiLU x up) in one
    MAX graph on the CPU, and its inputs: ``rows`` rows (one a stream), random NVFP4 codes in
    the tiled layout."""
    from max.driver import CPU, Buffer
    from max.dtype import DType
    from max.engine import InferenceSession
    from max.graph import DeviceRef, Graph, TensorType, ops

    from attnquant_kernels import kernels_path
    from attnquant_kernels.graph import generated_linear_nvfp4
    from attnquant_kernels.layout import tile_nvfp4
    from attnquant_kernels.testing import nvfp4_random

    dev, h, f = DeviceRef.CPU(), shape.hidden, shape.intermediate
    shapes = chain_shapes(shape, head)
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((rows, h)).astype(np.float32), np.ones(h, np.float32)]
    types = [TensorType(DType.float32, [rows, h], dev), TensorType(DType.float32, [h], dev)]
    for n, k in shapes:
        w, sc, s2 = nvfp4_random(rng, n, k)
        arrays += [*tile_nvfp4(w, sc), s2]
        types += [TensorType(DType.uint8, [n, k // 2], dev),
                  TensorType(DType.uint8, [n, k // 16], dev),
                  TensorType(DType.float32, [1], dev)]  # fmt: skip
    name = f"step_chain_{shape.name}_{'glue' if glue else 'proj'}_{activations}_{int(head)}"
    name += f"_rows{rows}" if rows != 1 else ""
    with Graph(name, input_types=types, custom_extensions=[kernels_path()]) as g:
        x, gamma = g.inputs[0].tensor, g.inputs[1].tensor
        ins = [v.tensor for v in g.inputs[2:]]

        def linear(i: int, a: Any) -> Any:
            w, sc, s2 = ins[3 * i : 3 * i + 3]
            return generated_linear_nvfp4(a, w, sc, s2, tiled=True, activations=activations)

        def norm(a: Any) -> Any:
            return ops.rms_norm(a, gamma, 1e-5) if glue else a

        for layer in range(shape.layers):
            i = 4 * layer
            qkv = linear(i, norm(x))
            o = linear(i + 1, qkv[:, : shapes[i + 1][1]])  # attention's output stands in
            x = x + o if glue else o
            gate_up = linear(i + 2, norm(x))
            inner = ops.silu(gate_up[:, :f]) * gate_up[:, f:] if glue else gate_up[:, :f]
            down = linear(i + 3, inner)
            x = x + down if glue else down
        g.output(linear(4 * shape.layers, norm(x)) if head else x)
    model = InferenceSession(devices=[CPU()]).load(g)
    weight_bytes = sum(a.nbytes for a in arrays[2:])
    return model, [Buffer.from_numpy(a) for a in arrays], weight_bytes


def llama_bench(bench: Path, gguf: Path, tokens: int, threads: int) -> float | None:
    """llama-bench's decode rate (tokens/s) over ``tokens`` new tokens, one repetition."""
    cmd = [bench, "-m", gguf, "-t", str(threads), "-p", "0", "-n", str(tokens), "-r", "1"]
    out = subprocess.run([*map(str, cmd), "-o", "json"], capture_output=True, text=True)
    if out.returncode != 0:
        return None
    return float(json.loads(out.stdout)[0]["avg_ts"])


def ms(values: list[float]) -> float:
    return 1e3 * statistics.median(values)


def main() -> None:
    import bench_compressed as bc
    import llamacpp
    from synthetic_llama import SHAPES, cached_synthetic

    from attnquant_cli._bench import prompt_ids

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="300m")
    parser.add_argument("--variant", default="nvfp4+head+emb", help="an NVFP4 bench_compressed row")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--settle", type=float, default=1.0, help="idle seconds before llama-bench")
    parser.add_argument("--work", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not args.variant.startswith("nvfp4"):
        raise SystemExit("profile_step times NVFP4 rows (nvfp4, nvfp4+head, ...)")
    shape = SHAPES[args.shape]
    work = args.work or Path(tempfile.mkdtemp(prefix="aq-step-"))
    base_dir = cached_synthetic(work, shape)
    common = {"max_length": args.prompt + args.new_tokens + 8, "max_batch_size": 1}
    path, overrides, how = bc.prepare(args.variant, base_dir, work, shape)
    loaded, how = bc.load_variant(args.variant, path, overrides, how, common)
    activations = "float" if overrides.get("nvfp4_int8") is False else "int8"
    head = bool(overrides.get("quant_head"))
    graph, sampler = wrap_pipeline(loaded)
    chains = {glue: chain_model(shape, head=head, glue=glue, activations=activations)
              for glue in (False, True)}  # fmt: skip
    # llama.cpp's step for scale where it is built (its Q4_K_M made once, then reused).
    bench = llamacpp.tool("llama-bench")
    gguf = llamacpp.cached_gguf(base_dir, work / "llamacpp", "q4_k_m") if bench.exists() else None
    run = bc.runner_of(loaded)
    prompt = prompt_ids(lambda t: list(range(3, 3 + len(t) // 4)), args.prompt)
    n = args.new_tokens
    for _ in range(2):
        run(prompt, n)
    parts: dict[str, list[float]] = {k: [] for k in ("wall", "graph", "sampler", "proj", "glue")}
    llama: list[float] = []
    for _ in range(args.runs):
        graph.seconds.clear()
        sampler.seconds.clear()
        t0 = time.perf_counter()
        run(prompt, n)
        wall = time.perf_counter() - t0
        # The first execute is the prompt's; the first sample follows it.
        parts["wall"].append((wall - graph.seconds[0] - sampler.seconds[0]) / (n - 1))
        # Means per step, as the wall time is, so the parts add up to it: a median call hides
        # the steps where the driving thread waited a scheduler slice for a core.
        parts["graph"].append(sum(graph.seconds[1:]) / (n - 1))
        parts["sampler"].append(sum(sampler.seconds[1:]) / (n - 1))
        for glue, (model, buffers, _) in chains.items():
            for _ in range(n):
                t0 = time.perf_counter()
                model.execute(*buffers)
                parts["glue" if glue else "proj"].append(time.perf_counter() - t0)
        if gguf is None:
            continue
        time.sleep(args.settle)  # MAX's workers spin for 0.1-0.2 s after a run
        rate = llama_bench(bench, gguf, n, os.cpu_count() or 1)
        if rate:
            llama.append(1.0 / rate)
    loaded.close()
    result = {k: ms(v) for k, v in parts.items()}
    result["python"] = result["wall"] - result["graph"] - result["sampler"]
    result["attention_and_rest"] = result["graph"] - result["glue"]
    result["llamacpp"] = ms(llama) if llama else None
    chain_bytes = chains[False][2]
    chain_gbps = chain_bytes / result["proj"] / 1e6
    rows = [
        ("a token, wall", result["wall"]),
        ("  the model's graph", result["graph"]),
        (f"    its projections alone ({chain_bytes / 1e6:.0f} MB, {chain_gbps:.1f} GB/s)",
         result["proj"]),
        ("    the same with norms, residuals, SiLU x up", result["glue"]),
        ("    attention, RoPE, KV cache, embedding (graph - that)",
         result["attention_and_rest"]),
        ("  the sampler's graph", result["sampler"]),
        ("  the pipeline's Python (wall - graph - sampler)", result["python"]),
    ]  # fmt: skip
    if result["llamacpp"]:
        rows.append(("llama.cpp Q4_K_M, its whole step (llama-bench)", result["llamacpp"]))
    print(f"{args.variant} ({how}, {activations} activations) at {args.shape}: "
          f"{args.prompt}-token prompt, {args.runs} x {n} tokens, medians")  # fmt: skip
    for label, value in rows:
        print(f"  {label:<66} {value:6.2f} ms")
    if args.out:
        meta = {"variant": args.variant, "served": how, "shape": args.shape,
                "activations": activations, "prompt": args.prompt, "new_tokens": n,
                "runs": args.runs, "chain_bytes": chain_bytes,
                "chain_gbps": chain_gbps}  # fmt: skip
        args.out.write_text(json.dumps({**meta, "ms": result}, indent=2) + "\n")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
