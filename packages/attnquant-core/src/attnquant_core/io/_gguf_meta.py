"""What a GGUF file says, read for :mod:`attnquant_core.io._gguf`: its metadata by name, the
Hugging Face key of each llama.cpp tensor name, llama.cpp's q/k row order, and the Hugging Face
``config.json`` of its hyperparameters."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .._errors import CheckpointError

__all__ = ["GGUF_ARCHITECTURES", "GGUFError", "ImportProgress", "permute_rope"]

#: GGUF ``general.architecture`` -> the Hugging Face architecture it is imported as. Mistral's
#: text models are written by llama.cpp as ``llama``.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}

# llama.cpp's block tensor names -> Hugging Face module names (the suffix, .weight or .bias, kept).
_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
}
# Gemma's four norms a layer: llama.cpp's ffn_norm is Gemma's pre-feedforward norm.
_GEMMA_BLOCK = {
    **_BLOCK,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_TOP = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_SUFFIXES = ("weight", "bias")


class GGUFError(CheckpointError):
    """A GGUF file attnquant cannot import: unreadable, an architecture, tensor or vocabulary it
    does not know."""


@dataclass(frozen=True)
class ImportProgress:
    """One tensor of :func:`import_gguf` done: its Hugging Face key, GGUF type, count so far."""

    key: str
    gguf_type: str
    done: int
    total: int


def _gguf() -> Any:
    try:
        import gguf
    except ImportError as exc:  # pragma: no cover - the extra is installed in every env we test
        raise GGUFError(
            "reading GGUF files needs the gguf package: pip install 'attnquant-core[gguf]'"
        ) from exc
    return gguf


def permute_rope(W: np.ndarray, heads: int, *, inverse: bool = False) -> np.ndarray:
    """llama.cpp's q/k row order for Llama: per head, the half-split RoPE pairs of Hugging Face
    interleaved (``inverse``: back to Hugging Face's order)."""
    rows = W.shape[0]
    if rows % (2 * heads):
        raise GGUFError(f"{rows} rows do not split into {heads} heads of RoPE pairs")
    if inverse:
        return W.reshape(heads, rows // heads // 2, 2, -1).swapaxes(1, 2).reshape(W.shape)
    return W.reshape(heads, 2, rows // heads // 2, -1).swapaxes(1, 2).reshape(W.shape)


class _Fields:
    """A GGUF's metadata by name, with errors that name the file and the key."""

    def __init__(self, reader: Any, path: Path) -> None:
        self._fields = dict(reader.fields)
        self.path = path

    def __contains__(self, name: str) -> bool:
        return name in self._fields

    def get(self, name: str, default: Any = None) -> Any:
        field = self._fields.get(name)
        return default if field is None else field.contents()

    def need(self, name: str) -> Any:
        if name not in self._fields:
            raise GGUFError(f"{self.path}: metadata {name!r} missing")
        return self.get(name)


def _hf_key(name: str, arch: str) -> str:
    """The Hugging Face key of a llama.cpp tensor name, or a :class:`GGUFError` naming it."""
    parts = name.split(".")
    block = _GEMMA_BLOCK if arch == "gemma3" else _BLOCK
    if len(parts) == 4 and parts[0] == "blk" and parts[3] in _SUFFIXES and parts[2] in block:
        return f"model.layers.{int(parts[1])}.{block[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _TOP and parts[1] in _SUFFIXES:
        return f"{_TOP[parts[0]]}.{parts[1]}"
    raise GGUFError(f"tensor {name!r} has no Hugging Face name in a {arch} model")


def _config(fields: _Fields, arch: str, n_vocab: int, tied: bool, shapes: Mapping) -> dict:
    """The Hugging Face ``config.json`` of the GGUF's hyperparameters."""
    p = f"{arch}."
    hidden = int(fields.need(p + "embedding_length"))
    heads = int(fields.need(p + "attention.head_count"))
    kv = fields.get(p + "attention.head_count_kv", heads)
    if not np.isscalar(kv) and len(set(kv)) != 1:
        raise GGUFError(f"{fields.path}: per-layer KV head counts {list(kv)} are not imported")
    kv_heads = int(kv if np.isscalar(kv) else kv[0])
    head_dim = int(fields.get(p + "attention.key_length", hidden // heads))
    layers = int(fields.need(p + "block_count"))
    inter = fields.need(p + "feed_forward_length")
    inter = int(inter if np.isscalar(inter) else inter[0])
    rope_dims = fields.get(p + "rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise GGUFError(
            f"{fields.path}: RoPE on {rope_dims} of {head_dim} head dimensions (partial rotary) "
            f"is not imported"
        )
    scaling = fields.get(p + "rope.scaling.type")
    # GGUF keeps float32: 1e-6 reads back as 9.99999997e-07; the shortest float32 repr is 1e-06
    eps = float(f"{float(fields.get(p + 'attention.layer_norm_rms_epsilon', 1e-6)):.7g}")
    ctx = int(fields.get(p + "context_length", 2048))
    ids = {
        "bos_token_id": fields.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": fields.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": fields.get("tokenizer.ggml.padding_token_id"),
    }
    ids = {k: (int(v) if v is not None else None) for k, v in ids.items()}
    base = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        **ids,
        "head_dim": head_dim,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "max_position_embeddings": ctx,
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": eps,
        "tie_word_embeddings": tied,
        "vocab_size": n_vocab,
        "torch_dtype": "float32",
    }
    theta = float(f"{float(fields.get(p + 'rope.freq_base', 10_000.0)):.7g}")
    if arch == "gemma3":
        if scaling not in (None, "none", "linear"):
            raise GGUFError(f"{fields.path}: Gemma 3 RoPE scaling {scaling!r} is not imported")
        from ._gemma3_config import gemma3_text_config

        window = fields.get(p + "attention.sliding_window")
        # llama.cpp: every 6th layer global where a window is set; the local RoPE base 10,000
        # unless the file says; queries scaled by 1/sqrt(head_dim), hidden/heads at 27B.
        pattern = 6 if window else 1
        scalar = hidden // heads if (layers, hidden) == (62, 5376) else head_dim
        cfg = gemma3_text_config(
            vocab_size=n_vocab,
            hidden_size=hidden,
            intermediate_size=inter,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            sliding_window=int(window or ctx),
            sliding_window_pattern=pattern,
            max_position_embeddings=ctx,
            query_pre_attn_scalar=scalar,
            rope_theta=theta,
            rope_local_base_freq=float(fields.get(p + "rope.freq_base_swa", 10_000.0)),
            final_logit_softcapping=fields.get(p + "final_logit_softcapping"),
            rms_norm_eps=eps,
            **{k: v for k, v in ids.items() if v is not None},
        )
        if scaling == "linear":
            factor = float(fields.need(p + "rope.scaling.factor"))
            cfg["rope_parameters"]["full_attention"].update(rope_type="linear", factor=factor)
            cfg["rope_scaling"] = {"rope_type": "linear", "factor": factor}
        cfg["architectures"] = [GGUF_ARCHITECTURES[arch]]
        cfg["tie_word_embeddings"] = tied
        cfg["torch_dtype"] = "float32"
        return cfg
    if scaling not in (None, "none"):
        raise GGUFError(f"{fields.path}: RoPE scaling {scaling!r} is not imported")
    model_type = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}[arch]
    cfg = {
        **base,
        "model_type": model_type,
        "hidden_act": "silu",
        "rope_theta": theta,
        "attention_bias": any(k.endswith("self_attn.q_proj.bias") for k in shapes),
        "mlp_bias": False,
    }
    window = fields.get(p + "attention.sliding_window")
    if window:
        cfg["sliding_window"] = int(window)
    if arch in ("qwen2", "qwen3"):
        cfg["use_sliding_window"] = bool(window)
        cfg["sliding_window"] = int(window) if window else None
    return cfg
