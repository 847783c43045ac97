"""``attnquant import`` checked against llama.cpp, the GGUF's own runtime.

For one GGUF (a path, or ``smollm2`` / ``gemma3`` for the real-models packages of the
``real-models`` dependency group), imported with :func:`attnquant_core.io.import_gguf`:

* **token ids**: the imported ``tokenizer.json`` against ``llama-server``'s ``/tokenize`` of the
  GGUF (special tokens added and parsed, as a prompt is), on every held-out and calibration
  document shipped with attnquant-cli and on a set of awkward strings;
* **greedy text and log-probabilities**: ``llama-server`` completes each prompt greedily on the
  GGUF as it is (quantized) and on its float32 rewrite (:func:`dequantize_gguf`, the very
  weights imported); attnquant-core's numpy float32 forward of the imported checkpoint scores
  llama.cpp's tokens teacher-forced: the share of steps where its argmax is llama.cpp's token,
  and the largest difference in the log-probability of that token.

Run: ``.venv/bin/python benchmarks/check_import.py smollm2 --out bench-results/import-smollm2.json``
(needs ``python benchmarks/llamacpp.py build``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
from scipy.special import log_softmax

sys.path.insert(0, str(Path(__file__).parent))
import llamacpp
import real_models

from attnquant_core.calib import read_texts
from attnquant_core.io import dequantize_gguf, import_gguf

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "packages" / "attnquant-cli" / "src" / "attnquant_cli" / "data"
AWKWARD = [
    "The capital of France is",
    "  two leading spaces, trailing  ",
    "tabs\tand\nnewlines\n\n\nthree",
    "digits 1234567890 and 3.14159, 1e-9",
    "unicode: émigré, naïve, Straße, 東京, 🦙🦙",
    "<|im_start|>user\nhi<|im_end|>\n<start_of_turn>user\nhi<end_of_turn>",
    "def f(x):\n\treturn x ** 2  # ok\n",
]
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village,",
]


def logits_fn(config: dict):
    if config.get("model_type", "").startswith("gemma"):
        from attnquant_core.gemma_reference import gemma3_logits

        return gemma3_logits
    from attnquant_core.llama_reference import llama_logits

    return llama_logits


def token_parity(server: llamacpp.LlamaServer, tok, texts: dict[str, str]) -> dict:
    import httpx

    out = {}
    for name, text in texts.items():
        body = {"content": text, "add_special": True, "parse_special": True}
        r = httpx.post(f"{server.url}/tokenize", json=body, timeout=600)
        r.raise_for_status()
        theirs = r.json()["tokens"]
        ours = tok.encode(text).ids
        n = min(len(theirs), len(ours))
        diff = [i for i in range(n) if theirs[i] != ours[i]]
        first = diff[0] if diff else (n if len(theirs) != len(ours) else None)
        out[name] = {
            "tokens": len(theirs),
            "ours": len(ours),
            "identical": first is None,
            "first_difference": first,
        }
        if first is not None:
            out[name]["around"] = {
                "llama_cpp": theirs[first : first + 5],
                "ours": ours[first : first + 5],
            }
    return out


def greedy_parity(server: llamacpp.LlamaServer, tok, config, state, n: int) -> list[dict]:
    import httpx

    logits = logits_fn(config)
    rows = []
    for prompt in PROMPTS:
        ids = tok.encode(prompt).ids
        body = {
            "prompt": ids,
            "n_predict": n,
            "temperature": 0.0,
            "top_k": 1,
            "samplers": ["top_k"],
            "n_probs": 1,
            "cache_prompt": False,
            "ignore_eos": True,
        }
        r = httpx.post(f"{server.url}/completion", json=body, timeout=600)
        r.raise_for_status()
        probs = r.json()["completion_probabilities"]
        theirs = [int(p["id"]) for p in probs]
        their_lp = [float(p["logprob"]) for p in probs]
        lp = log_softmax(
            logits(config, state, ids + theirs[:-1], dtype=np.float32).astype(np.float64), axis=-1
        )
        steps = lp[len(ids) - 1 :]
        ours = [int(a) for a in steps.argmax(-1)]
        ours_lp = [float(steps[i, t]) for i, t in enumerate(theirs)]
        rows.append(
            {
                "prompt": prompt,
                "llama_cpp_text": tok.decode(theirs),
                "same_argmax": float(np.mean([a == b for a, b in zip(ours, theirs, strict=True)])),
                "first_argmax_difference": next(
                    (i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None
                ),
                "max_abs_dlogp": max(abs(a - b) for a, b in zip(ours_lp, their_lp, strict=True)),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a GGUF path, or smollm2 / gemma3 (real-models packages)")
    parser.add_argument("--work", type=Path, default=real_models.cache() / "check_import")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    started = time.perf_counter()
    source = real_models.gguf_path(args.model)
    args.work.mkdir(parents=True, exist_ok=True)
    imported = args.work / f"{source.stem}-hf"
    t0 = time.perf_counter()
    summary = import_gguf(source, imported, overwrite=True)
    import_s = time.perf_counter() - t0
    f32 = dequantize_gguf(source, args.work / f"{source.stem}.F32.gguf")

    from safetensors.numpy import load_file
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(imported / "tokenizer.json"))
    config = json.loads((imported / "config.json").read_text())
    state = load_file(str(imported / "model.safetensors"))
    texts = {f"awkward {i}": t for i, t in enumerate(AWKWARD)}
    for split in ("heldout", "calibration"):
        for i, t in enumerate(read_texts([DATA / f"demo_{split}.jsonl"])):
            texts[f"{split} {i}"] = t
    result: dict = {"gguf": source.name, "import": summary, "import_s": round(import_s, 1)}
    with llamacpp.LlamaServer(source, ctx=4096) as server:
        result["token_ids"] = token_parity(server, tok, texts)
        result["greedy_gguf"] = greedy_parity(server, tok, config, state, args.new_tokens)
    # the float32 rewrite with a float32 KV cache too (llama-server's default is float16)
    with llamacpp.LlamaServer(f32, ctx=1024, extra=["-ctk", "f32", "-ctv", "f32"]) as server:
        result["greedy_f32"] = greedy_parity(server, tok, config, state, args.new_tokens)
    ids = result["token_ids"]
    same = sum(v["identical"] for v in ids.values())
    print(
        f"{source.name}: token ids identical in {same}/{len(ids)} texts "
        f"({sum(v['tokens'] for v in ids.values())} tokens)"
    )
    for kind in ("greedy_gguf", "greedy_f32"):
        for row in result[kind]:
            print(
                f"  {kind}: {row['prompt']!r}: argmax {row['same_argmax']:.3f}, "
                f"max |dlogp| {row['max_abs_dlogp']:.2e}: {row['llama_cpp_text']!r}"
            )
    result["wall_s"] = round(time.perf_counter() - started, 1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    bad = [k for k, v in ids.items() if not v["identical"]]
    if bad or any(not math.isfinite(r["max_abs_dlogp"]) for r in result["greedy_f32"]):
        raise SystemExit(f"token ids differ in {bad}")


if __name__ == "__main__":
    main()
