"""Synthetic Llama checkpoints of real-model shapes for the serving benchmarks, made on the fly.

Random weights (never shipped, never downloaded) with the shapes of a ~300M-parameter Llama and
of Llama-3.2-1B, written as a Hugging Face directory (``config.json``, the demo model's tokenizer,
sharded float32 safetensors) and, for MAX's own CPU 4-bit path, as a GGUF file (``q4_0``) beside
it, laid out as llama.cpp's converter lays it out (q/k rows permuted to the interleaved RoPE
layout MAX assumes for GGUF weights).

Projections are drawn with a decaying singular spectrum (``sigma_j ~ (1 + j/32)^-1``, scaled so
that a unit input keeps unit size), so that low-rank fits have something to keep, as in trained
weights; nothing here claims anything about quality on real text.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from llamacpp import _layer_order as _gguf_order
from llamacpp import gguf_name as _gguf_name
from llamacpp import permute_rope as _permute_rope

__all__ = ["SHAPES", "ModelShape", "projection_shapes", "write_gguf", "write_synthetic"]


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a Llama decoder."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tie_embeddings: bool

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def config(self) -> dict[str, object]:
        """A ``LlamaForCausalLM`` ``config.json``."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "torch_dtype": "float32",
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "rope_scaling": None,
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": self.tie_embeddings,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "pad_token_id": 2,
        }

    def parameters(self) -> tuple[int, int]:
        """(projection parameters, all parameters)."""
        proj = self.layers * sum(o * i for o, i in projection_shapes(self).values())
        embed = self.vocab * self.hidden * (1 if self.tie_embeddings else 2)
        norms = (2 * self.layers + 1) * self.hidden
        return proj, proj + embed + norms


SHAPES = {
    # ~300M: Llama-style, 20 layers of hidden 1024 (the projections hold 290M of the parameters).
    "300m": ModelShape("300m", 1024, 4096, 20, 16, 4, 32000, False),
    # Llama-3.2-1B: hidden 2048, 16 layers, MLP 8192, 32 query / 8 key-value heads, tied 128256.
    "1b": ModelShape("1b", 2048, 8192, 16, 32, 8, 128256, True),
    # A smoke-test size: compiles like the others, runs in seconds.
    "tiny": ModelShape("tiny", 256, 512, 2, 4, 2, 2048, False),
    # tiny's layer 20 times: 2.4 MB of float32 a layer, so a decode step is mostly the runtime's
    # own cost per layer (its dispatches), measured beside llama.cpp's on the same weights.
    "narrow": ModelShape("narrow", 256, 512, 20, 4, 2, 2048, False),
}


@dataclass(frozen=True)
class CheckpointShape(ModelShape):
    """The dimensions of a Llama checkpoint on disk (a real model): its own ``config.json``."""

    directory: Path = Path()

    def config(self) -> dict[str, object]:
        return json.loads((self.directory / "config.json").read_text())


def shape_of(directory: Path) -> CheckpointShape:
    """The :class:`ModelShape` of a Hugging Face Llama checkpoint ``directory``."""
    cfg = json.loads((Path(directory) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    if cfg.get("head_dim", cfg["hidden_size"] // heads) != cfg["hidden_size"] // heads:
        raise SystemExit(f"{directory}: head_dim != hidden / heads is not a ModelShape")
    return CheckpointShape(
        Path(directory).name,
        cfg["hidden_size"],
        cfg["intermediate_size"],
        cfg["num_hidden_layers"],
        heads,
        cfg["num_key_value_heads"],
        cfg["vocab_size"],
        bool(cfg.get("tie_word_embeddings")),
        directory=Path(directory),
    )


def projection_shapes(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """``[out, in]`` of the seven projections of one layer."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    h, f = shape.hidden, shape.intermediate
    return {
        "self_attn.q_proj": (q, h),
        "self_attn.k_proj": (kv, h),
        "self_attn.v_proj": (kv, h),
        "self_attn.o_proj": (h, q),
        "mlp.gate_proj": (f, h),
        "mlp.up_proj": (f, h),
        "mlp.down_proj": (h, f),
    }


def _decaying(rng: np.random.Generator, out_dim: int, in_dim: int) -> np.ndarray:
    """A random ``[out, in]`` float32 matrix with a decaying spectrum and unit input gain."""
    k = min(out_dim, in_dim)
    a = rng.standard_normal((out_dim, k), dtype=np.float32)
    b = rng.standard_normal((k, in_dim), dtype=np.float32)
    sigma = (1.0 + np.arange(k, dtype=np.float32) / 32.0) ** -1
    W = (a * sigma) @ b
    W *= np.float32(1.0 / np.sqrt(float(np.sum(sigma**2)) * in_dim / k) / np.sqrt(k))
    return W


def _layer_tensors(shape: ModelShape, layer: int, seed: int) -> Iterator[tuple[str, np.ndarray]]:
    rng = np.random.default_rng([seed, layer])
    for family, (o, i) in projection_shapes(shape).items():
        yield f"model.layers.{layer}.{family}.weight", _decaying(rng, o, i)
    ones = np.ones(shape.hidden, np.float32)
    yield f"model.layers.{layer}.input_layernorm.weight", ones
    yield f"model.layers.{layer}.post_attention_layernorm.weight", ones


def _other_tensors(shape: ModelShape, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([seed, 1 << 20])
    out = {
        "model.embed_tokens.weight": rng.standard_normal((shape.vocab, shape.hidden), np.float32),
        "model.norm.weight": np.ones(shape.hidden, np.float32),
    }
    if not shape.tie_embeddings:
        head = rng.standard_normal((shape.vocab, shape.hidden), np.float32)
        out["lm_head.weight"] = head / np.float32(np.sqrt(shape.hidden))
    return out


def pad_tokenizer(path: Path, vocab: int) -> None:
    """Give the (demo's, 2,048-token) tokenizer the model's ``vocab`` ids: ``<|unused_N|>``
    entries no merge produces, so encoding is unchanged, while a random model's greedy tokens
    above 2,047 are in the vocabulary (MAX's stock pipeline refuses out-of-vocabulary ids)."""
    if not path.exists():
        return
    tok = json.loads(path.read_text())
    table = tok["model"]["vocab"]
    taken = set(table.values()) | {t["id"] for t in tok.get("added_tokens", [])}
    for i in range(vocab):
        if i not in taken:
            table[f"<|unused_{i}|>"] = i
    path.write_text(json.dumps(tok, ensure_ascii=False))


def cached_synthetic(work: Path, shape: ModelShape) -> Path:
    """``work/float32``: the synthetic checkpoint of ``shape`` (the demo's tokenizer), written
    unless a ``config.json`` is already there."""
    from attnquant_cli import demo_model_path

    directory = work / "float32"
    if not (directory / "config.json").exists():
        write_synthetic(directory, shape, demo_model_path())
    return directory


def write_synthetic(
    directory: Path, shape: ModelShape, tokenizer_from: Path, *, seed: int = 0
) -> Path:
    """Write the synthetic float32 checkpoint of ``shape``: one safetensors shard per layer."""
    import safetensors.numpy

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(shape.config(), indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, directory / name)
    pad_tokenizer(directory / "tokenizer.json", shape.vocab)
    shards = shape.layers + 1
    weight_map: dict[str, str] = {}

    def save(index: int, tensors: dict[str, np.ndarray]) -> None:
        name = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        safetensors.numpy.save_file(tensors, directory / name)
        weight_map.update(dict.fromkeys(tensors, name))

    for layer in range(shape.layers):
        save(layer, dict(_layer_tensors(shape, layer, seed)))
    save(shape.layers, _other_tensors(shape, seed))
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}, indent=2)
    )
    return directory


#: Values per Q4_K super-block, and per sub-block of it (each with a 6-bit scale and min).
QK_K, Q4_K_SUB = 256, 32


def quantize_q4_k(W: np.ndarray) -> np.ndarray:
    """``W [N, K]`` (``K`` a multiple of 256) in llama.cpp's ``Q4_K`` layout: uint8
    ``[N, K / 256 * 144]``.

    The ``gguf`` package dequantizes Q4_K but cannot write it, so this writes the layout
    directly: per 256 values a float16 ``d`` and ``dmin``, 12 bytes packing eight 6-bit
    scales and mins (one pair per 32 values), and 128 bytes of 4-bit codes, each value
    ``d * sc * q - dmin * m``. The rounding is the plain one (each sub-block's range split into
    15 steps, the scales then rounded to 6 bits), not llama.cpp's searched one, so its error is
    an upper bound on what a llama.cpp file would carry; ``gguf.quants.dequantize`` reads it
    back (``tests/test_bench_q4_k.py``).
    """
    W = np.asarray(W, np.float32)
    N, K = W.shape
    if K % QK_K:
        raise ValueError(f"Q4_K needs rows of a multiple of {QK_K} values, got {K}")
    x = W.reshape(-1, QK_K // Q4_K_SUB, Q4_K_SUB)  # [blocks, 8, 32]
    lo = np.minimum(x.min(axis=-1), 0.0)  # the min is subtracted: m >= 0
    hi = x.max(axis=-1)
    scale = (hi - lo) / 15  # per sub-block
    mins = -lo
    d = (scale.max(axis=-1) / 63).astype(np.float16)  # [blocks]
    dmin = (mins.max(axis=-1) / 63).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32 > 0, np.rint(scale / d32), 0).clip(0, 63).astype(np.uint8)
        m = np.where(dmin32 > 0, np.rint(mins / dmin32), 0).clip(0, 63).astype(np.uint8)
        step = (d32 * sc)[..., None]
        offset = (dmin32 * m)[..., None]
        q = np.where(step > 0, np.rint((x + offset) / step), 0).clip(0, 15).astype(np.uint8)
    # The 12 scale bytes (gguf.quants.Q4_K.get_scale_min read backwards): bytes 0-3 the low 6
    # bits of scales 0-3 with the high 2 bits of scales 4-7 above; 4-7 the same for the mins;
    # 8-11 the low 4 bits of scales 4-7 and, above, of mins 4-7.
    packed = np.empty((x.shape[0], 12), np.uint8)
    packed[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((m[:, 4:8] & 0x0F) << 4)
    # Codes: per 64 values (sub-blocks 2i, 2i+1), byte l holds value l low and value 32 + l high.
    pairs = q.reshape(-1, 4, 2, Q4_K_SUB)
    codes = (pairs[:, :, 0, :] | (pairs[:, :, 1, :] << 4)).reshape(-1, 128)
    blocks = np.concatenate(
        [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed, codes],
        axis=1,
    )
    return blocks.reshape(N, K // QK_K * 144)


def write_gguf(checkpoint: Path, out: Path, shape: ModelShape, *, quant: str = "q4_0") -> int:
    """Write ``checkpoint`` as a GGUF file with every matrix in ``quant`` (``q4_0``, or ``q4_k``
    by :func:`quantize_q4_k`) and the norms in float32, as MAX's CPU 4-bit Llama reads it;
    returns the tensor bytes written."""
    import gguf
    from safetensors import safe_open

    qtype = {"q4_0": gguf.GGMLQuantizationType.Q4_0, "q4_k": gguf.GGMLQuantizationType.Q4_K}[quant]
    file_type = {"q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "q4_k": gguf.LlamaFileType.MOSTLY_Q4_K_M}
    quantize = quantize_q4_k if quant == "q4_k" else (lambda W: gguf.quants.quantize(W, qtype))
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_context_length(2048)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(500000.0)
    writer.add_vocab_size(shape.vocab)
    writer.add_file_type(file_type[quant])
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"]
    total = 0
    for key in sorted(index, key=_gguf_order):
        with safe_open(checkpoint / index[key], "numpy") as f:
            W = f.get_tensor(key)
        name = _gguf_name(key)
        if key.endswith("q_proj.weight"):
            W = _permute_rope(W, shape.heads)
        elif key.endswith("k_proj.weight"):
            W = _permute_rope(W, shape.kv_heads)
        if W.ndim == 2:
            data = quantize(W)
            writer.add_tensor(name, data, raw_dtype=qtype)
        else:
            data = W.astype(np.float32)
            writer.add_tensor(name, data)
        total += data.nbytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return total
