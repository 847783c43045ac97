"""Serving a compressed model on the CPU: bytes held, decode, prefill and TTFT against float32.

A synthetic Llama of real-model shapes (``--shape 300m``: ~320M parameters; ``--shape 1b``:
Llama-3.2-1B's shapes; ``--shape tiny`` for a smoke run; made on the fly by
``synthetic_llama.py``, random weights, never shipped) is served by MAX beside the stock float32
model, one variant at a time, and timed as ``attnquant bench`` times it (adjacent pairs in ABBA
order after a discarded warm-up run of each, ``--settle`` idle seconds before each timed run so
that MAX's workers, which spin for 0.1-0.2 s after a run, do not slow the next side's run;
THETA/BASE as the geometric mean of within-pair ratios with a bootstrap-over-pairs 95% CI; the
machine's load beside each row):

* ``float32``: the base itself, served again (what ``--against`` times it against);
* ``float32 custom-op``: the same dense weights on attnquant's own float ops (``--path
  custom-op``: decomposed at load at passthrough, one ``generated_linear`` per projection and one
  ``generated_mlp`` per MLP) instead of MAX's stock matmul: the issue's "offer attnquant's ops
  where they decode a dense model faster";
* ``budget 0.7`` / ``budget 0.5``: ``decompose --budget`` checkpoints, served in the graph
  (``ATTNQUANT_PRECOMPUTE_OUTSIDE=0``, GEMM path) where attnquant-max serves their forms there,
  else on precompute-outside (dense rebuilt at load: no smaller, no faster), and the row says so;
  ``budget 0.7 custom-op`` / ``budget 0.5 custom-op``: the same checkpoints on the custom op
  (``ATTNQUANT_GEMM=0``: one ``generated_lowrank`` per low-rank or shared-basis projection);
* ``nvfp4``: the stock checkpoint served with ``ATTNQUANT_QUANT=nvfp4``, each projection one fused
  ``generated_linear_nvfp4`` dispatch (``ATTNQUANT_NVFP4_KERNEL=fused``);
* ``nvfp4+r16``: ``decompose --quant nvfp4 --rank 16`` (format v4), served in the graph as stored
  (``ATTNQUANT_PRECOMPUTE_OUTSIDE=0``): the packed ``W0``, ``s``, ``U``, ``V`` of each projection
  in one fused ``generated_linear_nvfp4`` dispatch;
* ``nvfp4+head`` / ``nvfp4+r16+head`` / ``budget 0.5 custom-op+head``: the same with the
  output head in NVFP4 too
  (``ATTNQUANT_QUANT_HEAD=1``: one more fused dispatch a step, reading 4.5 bits a weight where
  the float32 head reads 32), as the GGUF rows hold theirs in 4 bits;
* ``nvfp4 row-major`` / ``nvfp4+r16 row-major``: the same weights held in Model Optimizer's
  row-major layout, where the rows above are held in the tiled layout on an AVX-512 CPU
  (``generated_linear_nvfp4_tiled``): what the tiled layout buys, side by side;
* ``nvfp4 per-member`` / ``nvfp4+head per-member``: q/k/v and gate/up one fused dispatch per
  member and a concat, where the rows above merge each group's packed weights at load into one
  dispatch (``NVFP4MergedLinear``): what merging buys, side by side;
* ``nvfp4 float`` / ``nvfp4+head float``: the tiled rows with ``--no-nvfp4-int8``: decode
  steps multiply float activations, where the rows above (``--nvfp4-int8``, the default) round
  them to int8 per group of 64 and multiply integers (``generated_linear_nvfp4_tiled_a8``);
* ``gguf q4_0`` / ``gguf q4_k``: what a CPU user picks instead for 4-bit: the same weights
  written as a GGUF ``q4_0`` file (``gguf`` package, llama.cpp's layout) or ``q4_k`` file
  (``synthetic_llama.quantize_q4_k``: the ``gguf`` package cannot write K-quants) and served
  by MAX's own CPU 4-bit path (the stock MAX Llama, every matrix including the embedding and
  head in that encoding);
* ``llama.cpp f32`` / ``llama.cpp q4_0`` / ``llama.cpp q4_k_m``: what a CPU user runs instead of
  MAX: the same weights as a float32 GGUF (``llamacpp.hf_to_gguf``), quantized by llama.cpp's
  own ``llama-quantize`` (Q4_K_M: its K-quant mix, Q6_K head and half the ``attn_v`` /
  ``ffn_down``), served by ``llama-server`` with as many threads as the machine has cores and
  given what the MAX rows are (the prompt as token ids, ``ignore_eos``, no prompt cache), each
  run one request timed by llama-server itself (its ``timings``: prompt and generation; two
  requests timed from outside differ by less than their HTTP latency on a small model); their
  logit distance is
  the numpy forward of the GGUF's dequantized weights against float32's greedy tokens. llama.cpp
  is built once into a cache (``python benchmarks/llamacpp.py build``).

For each: weight bytes the compiled model holds, decode tok/s at batch 1 (64 new tokens after a
``--prompt-tokens`` prompt), prefill tok/s of that prompt and time to first token, each as a ratio
to float32, and the logit distance to float32 (max |log-prob delta| of float32's greedy tokens
and greedy agreement, over 4 prompts x 16 tokens). The roofline beside them: the fastest decode
the bytes allow, the bytes per second a float32 matrix-vector product reads on every core
(numpy's BLAS: what a decode step does to its weights) over the bytes one decode step reads
(every weight held, less an embedding table that is not also the head, of which a step reads
one row). The JSON keeps beside it the roofline of the numpy copy (one thread, bytes read plus
written per second) that the README's earlier rows were given.

Run: ``HF_HUB_OFFLINE=1 uv run python benchmarks/bench_compressed.py --shape 300m --out r.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from kernels_nvfp4 import memory_bandwidth, read_bandwidth
from synthetic_llama import SHAPES, cached_synthetic, projection_shapes, shape_of, write_gguf

VARIANTS = (
    "float32",
    "float32 custom-op",
    "budget 0.7",
    "budget 0.5",
    "budget 0.7 custom-op",
    "budget 0.5 custom-op",
    "budget 0.5 custom-op+head",
    "nvfp4",
    "nvfp4+r16",
    "nvfp4+head",
    "nvfp4+head+emb",
    "nvfp4+r16+head",
    "nvfp4 row-major",
    "nvfp4+r16 row-major",
    "nvfp4 per-member",
    "nvfp4+head per-member",
    "nvfp4 float",
    "nvfp4+head float",
    "nvfp4+head+emb float",
    "gguf q4_0",
    "gguf q4_k",
    "llama.cpp f32",
    "llama.cpp q4_0",
    "llama.cpp q4_k_m",
)
#: Variant suffixes that serve the same weights another way: the serving option, its value,
#: and what the row says.
LAYOUT_SUFFIXES = {
    " row-major": ("nvfp4_tiled", False, "row-major layout"),
    " per-member": ("nvfp4_merge", False, "one dispatch per q/k/v and gate/up member"),
    " float": ("nvfp4_int8", False, "float activations"),
}
PARITY_PROMPTS = ["def main(argv):", "class Reader:", "import os\nimport sys\n", "for i in range("]


def _table_bytes(shape: Any, variant: str | None) -> float:
    """Bytes of the embedding table: float32 in every variant but the GGUF ones
    (q4_0: 18 bytes a 32 weights; q4_k: 144 a 256) and the ``+emb`` ones
    (``ATTNQUANT_QUANT_EMBEDDING=1``: NVFP4, 4.5 bits a weight and the per-tensor scale)."""
    if "+emb" in (variant or ""):
        return shape.vocab * shape.hidden * 9 / 16 + 4
    per_weight = {"gguf q4_0": 18 / 32, "gguf q4_k": 144 / 256}.get(variant or "", 4)
    return shape.vocab * shape.hidden * per_weight


def _head_bytes(shape: Any, variant: str | None) -> float | None:
    """Bytes of a head held apart from the embedding table (``None``: a tied head, the table
    itself): NVFP4 in the ``+head`` variants (``ATTNQUANT_QUANT_HEAD=1``: 4.5 bits a weight
    and the per-tensor scale; a tied head is then quantized from the table, which stays, but
    with ``+emb``, where the lookup reads the head's bytes: one table again)."""
    if shape.tie_embeddings and "+emb" in (variant or ""):
        return None
    if "+head" in (variant or ""):
        return shape.vocab * shape.hidden * 9 / 16 + 4
    return None if shape.tie_embeddings else _table_bytes(shape, variant)


def streamed_bytes(held: int, shape: Any, variant: str | None = None) -> int:
    """Bytes one batch-1 decode step reads: ``held`` less an embedding table that is not the
    head (of which it reads one row)."""
    if _head_bytes(shape, variant) is None:
        return held
    table = _table_bytes(shape, variant)
    return held - int(table) + int(table / shape.vocab)


def projection_bytes(held: int, shape: Any, variant: str | None = None) -> int:
    """Of ``held``, the projections' bytes: what is not the embedding, head and norms
    (float32 norms in every variant)."""
    head = _head_bytes(shape, variant) or 0
    norms = (2 * shape.layers + 1) * shape.hidden * 4
    return held - int(_table_bytes(shape, variant)) - int(head) - norms


def _stock_loaded(directory: Path, gguf: Path, *, max_length: int, encoding: str = "q4_0") -> Any:
    """MAX's own Llama on a GGUF file (attnquant's architectures read safetensors only)."""
    from max.pipelines import AutoModel, AutoTokenizer

    from attnquant_max import LoadedModel

    model = AutoModel(
        str(directory),
        max_batch_size=8,
        devices="cpu",
        max_length=max_length,
        quantization_encoding=encoding,
        weight_path=[str(gguf)],
    )
    return LoadedModel(
        path=directory,
        model=model,
        tokenizer=AutoTokenizer(str(directory)),
        max_batch_size=8,
        max_length=max_length,
    )


def prepare(
    variant: str, base_dir: Path, work: Path, shape: Any, forms: tuple[str, ...] | None = None
) -> tuple[Path, dict, str]:
    """The checkpoint of ``variant``, the attnquant config overrides to serve it, and how.

    ``forms`` narrows the budget fit's search (``None``: every form, as ``decompose --budget``).
    """
    from attnquant_core import decompose_budget

    # Suffixes first: "budget 0.5 custom-op+head" is the budget row with the head in NVFP4.
    for suffix, (option, value, said) in LAYOUT_SUFFIXES.items():
        if variant.endswith(suffix):
            base = variant.removesuffix(suffix)
            path, overrides, how = prepare(base, base_dir, work, shape, forms)
            return path, {**overrides, option: value}, f"{how} ({said})"
    if variant.endswith("+emb"):
        base = variant.removesuffix("+emb")
        path, overrides, how = prepare(base, base_dir, work, shape, forms)
        return path, {**overrides, "quant_embedding": True}, how + "; embedding NVFP4 too"
    if variant.endswith("+head"):
        base = variant.removesuffix("+head")
        path, overrides, how = prepare(base, base_dir, work, shape, forms)
        head = {"nvfp4_kernel": "fused", **overrides, "quant_head": True}
        return path, head, how + "; head NVFP4 too"
    if variant.startswith("budget"):
        budget = variant.split()[1]
        out = work / f"budget_{budget}"  # one checkpoint for both in-graph paths
        if not out.exists():
            narrowed = {"forms": forms} if forms else {}
            decompose_budget(base_dir, out, budget=float(budget), **narrowed)
        op = variant.endswith("custom-op")
        how = "in graph, " + ("custom op (generated_lowrank)" if op else "GEMM path")
        how += f" (forms {'/'.join(forms)})" if forms else ""
        return out, {"path": "custom-op" if op else "gemm"}, how
    # The fused op named, not timed at start-up (ATTNQUANT_NVFP4_KERNEL=auto): every run of
    # this benchmark serves the same graph.
    if variant == "nvfp4":
        overrides = {"path": "precompute-outside", "quant": "nvfp4", "nvfp4_kernel": "fused"}
        return base_dir, overrides, "--quant nvfp4, fused generated_linear_nvfp4"
    if variant == "nvfp4+r16":
        out = work / "nvfp4_r16"
        if not out.exists():
            from attnquant_core import decompose_checkpoint

            decompose_checkpoint(base_dir, out, blocks="layers", rank=16, quant="nvfp4")
        overrides = {"path": "in-graph", "nvfp4_kernel": "fused"}
        return out, overrides, "in graph, packed W0 + s, U, V in fused generated_linear_nvfp4"
    if variant == "float32":  # a second copy of the base, to time against --against
        return base_dir, {"path": "precompute-outside"}, "float32, MAX's stock graph"
    if variant == "float32 custom-op":
        how = "float32 at passthrough, attnquant's float ops (generated_linear, generated_mlp)"
        return base_dir, {"path": "custom-op"}, how
    if variant.startswith("llama.cpp"):
        import llamacpp

        quant = variant.split()[1]
        out = llamacpp.cached_gguf(base_dir, work / "llamacpp", quant)
        return out, {}, f"llama.cpp {quant.upper()} (llama-server, llama-quantize)"
    if variant.startswith("gguf"):
        quant = variant.split()[1]
        out = work / f"gguf_{quant}"
        if not out.exists():
            out.mkdir()
            for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
                shutil.copy(base_dir / name, out / name)
            write_gguf(base_dir, out / f"model-{quant}.gguf", shape, quant=quant)
        return out, {}, f"MAX's CPU {quant} (stock Llama)"
    raise ValueError(variant)


def load_variant(variant: str, path: Path, overrides: dict, how: str, common: dict) -> tuple:
    """Load ``variant``; where its in-graph path is refused, fall back to precompute-outside."""
    from attnquant_max import ServingOptions, load_pipeline

    if variant.startswith("llama.cpp"):
        import llamacpp

        threads = os.cpu_count() or 1
        return llamacpp.LlamaCppModel(path, threads=threads, ctx=common["max_length"]), how
    if variant.startswith("gguf"):
        quant = variant.split()[1]
        gguf = path / f"model-{quant}.gguf"
        return _stock_loaded(path, gguf, max_length=common["max_length"], encoding=quant), how
    options = ServingOptions(**{"path": "precompute-outside", **overrides})
    try:
        return load_pipeline(path, options=options, **common), how
    except NotImplementedError as exc:
        if options.path == "precompute-outside":  # not an in-graph request: a real error
            raise
        reason = str(exc).split(". ")[0]
        loaded = load_pipeline(path, options=ServingOptions(path="precompute-outside"), **common)
        return loaded, f"precompute-outside (in-graph refused: {reason})"


def runner_of(loaded: Any) -> Any:
    """What ``bench_pair`` times: a MAX model's ``generate``, or llama-server's completion."""
    from attnquant_cli._bench import generate_runner

    return loaded.runner() if hasattr(loaded, "runner") else generate_runner(loaded)


def sampler_of(loaded: Any, prompt: list[int], new_tokens: int) -> Any:
    """One timed run of ``loaded``: a MAX model timed from outside as ``attnquant bench`` times
    it, a llama.cpp model by llama-server's own timings (``LlamaCppModel.sample``)."""
    from attnquant_cli._bench import measure

    if hasattr(loaded, "sample"):
        return lambda: loaded.sample(prompt, new_tokens)
    run = runner_of(loaded)
    return lambda: measure(run, prompt, new_tokens)


def parity_of(base: Any, loaded: Any, shape: Any) -> Any:
    """Logit distance to float32 over :data:`PARITY_PROMPTS` x 16 greedy tokens: MAX models
    teacher-forced through MAX, a llama.cpp GGUF through the numpy forward of its weights."""
    from attnquant_max import ParityReport, greedy_generate, greedy_logprobs, logit_parity

    if not hasattr(loaded, "scores"):
        return logit_parity(base, loaded, PARITY_PROMPTS, 16)
    prompts = [base.encode(p) for p in PARITY_PROMPTS]
    tokens = [greedy_generate(base, ids, 16) for ids in prompts]
    ours = [greedy_logprobs(base, ids, c) for ids, c in zip(prompts, tokens, strict=True)]
    theirs = [loaded.scores(shape.config(), ids, c) for ids, c in zip(prompts, tokens, strict=True)]
    return ParityReport.from_scores(ours, theirs, tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="300m")
    parser.add_argument(
        "--model",
        type=Path,
        help="a Hugging Face Llama checkpoint (a real model, e.g. one `attnquant import` made) "
        "in place of the synthetic --shape",
    )
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--pairs", type=int, default=8, help="timed ABBA pairs per variant")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument(
        "--settle",
        type=float,
        default=0.5,
        help="seconds idle before each timed run, so the other side's spinning threads stop",
    )
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument(
        "--forms",
        nargs="+",
        choices=["banded", "lowrank", "shared_basis"],
        help="narrow the budget rows' fit to these forms (default: every form; the full "
        "search over banded and shared-basis candidates takes long at 300M on 2 cores)",
    )
    parser.add_argument(
        "--against",
        choices=VARIANTS,
        help="time every variant against this one instead of float32 (one model served two "
        "ways, paired: 'budget 0.5' against 'budget 0.5 custom-op'); logit distance and "
        "rooflines stay against float32",
    )
    parser.add_argument("--work", type=Path, help="keep the checkpoints here (default: a temp dir)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()

    from attnquant_cli._bench import prompt_ids, summarize
    from attnquant_core import machine_load, read_load, run_paired
    from attnquant_max import ServingOptions, load_pipeline

    shape = shape_of(args.model) if args.model else SHAPES[args.shape]
    proj_params, all_params = shape.parameters()
    work = args.work or Path(tempfile.mkdtemp(prefix="aq-bench-compressed-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    base_dir = args.model.resolve() if args.model else cached_synthetic(work, shape)
    print(
        f"{shape.name}: {all_params / 1e6:.0f}M parameters ({proj_params / 1e6:.0f}M in "
        f"projections {sorted(set(projection_shapes(shape).values()))}); written in "
        f"{time.perf_counter() - t0:.0f} s"
    )
    copy_bandwidth = memory_bandwidth()
    bandwidth = read_bandwidth()
    print(
        f"memory bandwidth: {bandwidth / 1e9:.1f} GB/s read (numpy float32 matrix-vector "
        f"product, every core), {copy_bandwidth / 1e9:.1f} GB/s copied (numpy copy, one thread, "
        "read + write)"
    )
    common = {"max_length": args.prompt_tokens + args.new_tokens + 8, "max_batch_size": 8}
    base = load_pipeline(base_dir, options=ServingOptions(path="precompute-outside"), **common)
    base_bytes = base.weight_bytes or 4 * all_params
    prompt = prompt_ids(base.encode, args.prompt_tokens)
    timed_base, against = base, None
    if args.against:
        path, overrides, how = prepare(
            args.against, base_dir, work, shape, tuple(args.forms) if args.forms else None
        )
        against, how = load_variant(args.against, path, overrides, how, common)
        timed_base = against
        print(f"ratios against {args.against} ({how}), not float32", flush=True)
    results: dict[str, Any] = {
        "benchmark": "compressed",
        "shape": shape.config(),
        "parameters": {"projections": proj_params, "all": all_params},
        "bandwidth_bytes_per_s": bandwidth,
        "bandwidth_method": "numpy float32 matrix-vector product over 1 GiB, bytes read / best",
        "copy_bandwidth_bytes_per_s": copy_bandwidth,
        "base": {
            "weight_bytes": base_bytes,
            "streamed_bytes": streamed_bytes(base_bytes, shape),
            "roofline_tok_s": bandwidth / streamed_bytes(base_bytes, shape),
            "copy_roofline_tok_s": copy_bandwidth / streamed_bytes(base_bytes, shape),
        },
        "variants": {},
        "ratios_against": args.against or "float32",
    }
    try:
        for variant in args.variants:
            t0 = time.perf_counter()
            path, overrides, how = prepare(
                variant, base_dir, work, shape, tuple(args.forms) if args.forms else None
            )
            prepared_s = time.perf_counter() - t0
            loaded, how = load_variant(variant, path, overrides, how, common)
            try:
                held = loaded.weight_bytes or sum(f.stat().st_size for f in path.glob("*.gguf"))
                parity = parity_of(base, loaded, shape)
                streamed = getattr(loaded, "streamed_bytes", None)
                streamed = streamed or streamed_bytes(held, shape, variant)
                projected = getattr(loaded, "projection_bytes", None)
                projected = projected or projection_bytes(held, shape, variant)
                before = read_load()
                runs = run_paired(
                    sampler_of(loaded, prompt, args.new_tokens),
                    sampler_of(timed_base, prompt, args.new_tokens),
                    pairs=args.pairs,
                    warmup=args.warmup,
                    settle=args.settle,
                )
                load = machine_load(before)
            finally:
                loaded.close()
            summary = summarize(runs, gate=None, load=load)
            row = {
                "served": how,
                "prepare_s": prepared_s,
                "weight_bytes": held,
                "bytes_ratio": held / base_bytes,
                "projection_bytes_ratio": projected / (4 * proj_params),
                "streamed_bytes": streamed,
                "roofline_tok_s": bandwidth / streamed,
                "copy_roofline_tok_s": copy_bandwidth / streamed,
                "max_abs_logprob_delta": parity.max_abs_logprob_delta,
                "agreement": parity.agreement,
                **summary,
            }
            results["variants"][variant] = row
            r = summary["ratios"]
            print(
                f"{variant:<11} {how}: bytes {held / 1e6:.0f} MB ({held / base_bytes:.3f}x); "
                + "  ".join(
                    f"{m.split('_')[0]} {r[m]['ratio']:.3f} [{r[m]['ci_low']:.3f}, "
                    f"{r[m]['ci_high']:.3f}]"
                    for m in ("decode_tok_s", "prefill_tok_s", "ttft_s")
                )
                + f"; decode {summary['medians']['theta']['decode_tok_s']:.1f} tok/s (roofline "
                f"{row['roofline_tok_s']:.1f}), {args.against or 'float32'} "
                f"{summary['medians']['base']['decode_tok_s']:.1f}"
                + ("" if args.against else f" (roofline {results['base']['roofline_tok_s']:.1f})")
                + "; "
                f"max|dlogp| {parity.max_abs_logprob_delta:.3f}, agreement "
                f"{100 * parity.agreement:.1f}%; {load.describe()}",
                flush=True,
            )
            if args.out:
                args.out.write_text(json.dumps(results, indent=2) + "\n")
    finally:
        base.close()
        if against is not None:
            against.close()
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
