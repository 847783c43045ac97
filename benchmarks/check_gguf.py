"""Is a GGUF file written like ``synthetic_llama.write_gguf`` read right by MAX's own Llama?

Writes the embedded demo model as a GGUF file, ``f32`` (every tensor float32) or ``q4_0``
(matrices in GGML ``Q4_0``), with the same tensor names and q/k RoPE row permutation as
``write_gguf``, serves it through MAX's stock Llama (``quantization_encoding`` float32 or q4_0,
``weight_path`` the file) and compares the greedy tokens and teacher-forced log-probabilities
with the safetensors model served by attnquant. ``f32`` separates the file's layout from the
4-bit path: matching log-probabilities there mean names, permutation and metadata are right.

    python benchmarks/check_gguf.py f32|q4_0 [--work DIR]

CPU only; nothing is downloaded (``HF_HUB_OFFLINE=1``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from llamacpp import _layer_order as _gguf_order
from llamacpp import gguf_name as _gguf_name
from llamacpp import permute_rope as _permute_rope

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MAX_SERVE_DISABLE_TELEMETRY", "1")


def write_demo_gguf(demo: Path, out_dir: Path, kind: str) -> Path:
    """``out_dir``: the demo's config and tokenizer beside ``model-KIND.gguf``."""
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((demo / "config.json").read_text())
    shutil.copytree(demo, out_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    qtype = {"f32": gguf.GGMLQuantizationType.F32, "q4_0": gguf.GGMLQuantizationType.Q4_0}[kind]
    path = out_dir / f"model-{kind}.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg["rope_theta"])
    writer.add_vocab_size(cfg["vocab_size"])
    file_type = gguf.LlamaFileType.ALL_F32 if kind == "f32" else gguf.LlamaFileType.MOSTLY_Q4_0
    writer.add_file_type(file_type)
    tensors = load_file(str(demo / "model.safetensors"))
    for key in sorted(tensors, key=_gguf_order):
        W = tensors[key]
        if key.endswith("q_proj.weight"):
            W = _permute_rope(W, cfg["num_attention_heads"])
        elif key.endswith("k_proj.weight"):
            W = _permute_rope(W, cfg["num_key_value_heads"])
        if W.ndim == 2 and kind == "q4_0":
            writer.add_tensor(_gguf_name(key), gguf.quants.quantize(W, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(_gguf_name(key), np.ascontiguousarray(W, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=("f32", "q4_0"))
    parser.add_argument("--work", type=Path, help="write the GGUF model here (default: temp)")
    args = parser.parse_args()

    from max.pipelines import AutoModel, AutoTokenizer

    from attnquant_cli._demo import demo_model_path
    from attnquant_max import LoadedModel, greedy_generate, greedy_logprobs
    from attnquant_max._generate import load_pipeline

    demo = demo_model_path()
    work = args.work or Path(tempfile.mkdtemp(prefix="aq-gguf-"))
    out_dir = work / args.kind
    shutil.rmtree(out_dir, ignore_errors=True)
    path = write_demo_gguf(demo, out_dir, args.kind)
    encoding = "float32" if args.kind == "f32" else "q4_0"
    model = AutoModel(
        str(out_dir),
        max_batch_size=1,
        devices="cpu",
        max_length=256,
        quantization_encoding=encoding,
        weight_path=[str(path)],
    )
    served = LoadedModel(
        path=out_dir,
        model=model,
        tokenizer=AutoTokenizer(str(out_dir)),
        max_batch_size=1,
        max_length=256,
    )
    reference = load_pipeline(demo, max_length=256)
    ids = reference.encode("def main(")
    tokens = greedy_generate(reference, ids, 12)
    agree = np.mean(np.array(greedy_generate(served, ids, 12)) == np.array(tokens))
    want = np.asarray(greedy_logprobs(reference, ids, tokens).logprobs)
    got = np.asarray(greedy_logprobs(served, ids, tokens).logprobs)
    print(
        f"{args.kind}: {path.stat().st_size} B; greedy agreement {agree:.3f} over 12 tokens; "
        f"max |dlog p| {np.abs(got - want).max():.3g} on the reference's tokens"
    )


if __name__ == "__main__":
    main()
