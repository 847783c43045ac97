"""Tiny Gemma 3 and Gemma 4 checkpoints made in numpy, never downloaded.

Three layouts, each a Hugging Face directory (``config.json``, ``model.safetensors``, optionally
a byte-level tokenizer):

* :func:`write_tiny_gemma3` — ``Gemma3ForCausalLM`` (``model_type`` ``gemma3_text``, the Gemma 3
  1B layout): keys ``model.layers.{i}...``, tied embeddings (no ``lm_head.weight``).
* :func:`write_tiny_gemma3_conditional` — the text part of ``Gemma3ForConditionalGeneration``
  (the 4B/12B/27B layout) under the keys the released checkpoints and MAX 26.7's adapter use,
  ``language_model.model.layers.{i}...``; no vision tower weights are written.
* :func:`write_tiny_gemma4` — the text decoder of ``Gemma4ForConditionalGeneration`` as MAX
  26.7 reads it (``model.language_model.layers.{i}...``, ``layer_scalar`` per layer); by
  default shaped like Gemma 4 31B: global layers with their own head size
  (``global_head_dim``) and key/value heads, and no ``v_proj`` (``attention_k_eq_v``).

Every Gemma feature the decoder has is present: q/k norms, pre/post feed-forward norms,
sliding-window and global layers (``layer_types``), tied embeddings, the ``sqrt(hidden)``
embedding scale (a model property, nothing stored), bf16 storage. The config dicts equal what
``transformers`` (5.x) writes for the same sizes, plus ``architectures`` and ``dtype`` as
``save_pretrained`` adds them; the test suite checks this where ``transformers`` is installed.
This module needs numpy, ``ml_dtypes`` and ``safetensors`` only (``tokenizers`` for
``tokenizer=True``).

Weights are random but correlated across layers (a shared part plus per-layer noise, like a
trained stack), fixed by ``seed``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import safetensors.numpy

from .testing import write_byte_tokenizer

__all__ = [
    "TRANSFORMERS_VERSION",
    "gemma3_conditional_config",
    "gemma3_text_config",
    "gemma3_text_tensors",
    "gemma4_config",
    "gemma4_text_tensors",
    "write_tiny_gemma3",
    "write_tiny_gemma3_conditional",
    "write_tiny_gemma4",
]

#: The ``transformers`` release whose ``config.json`` these dicts reproduce.
TRANSFORMERS_VERSION = "5.12.1"

#: Token ids of the optional byte-level tokenizer: 256 byte tokens, then these specials.
_TOKENIZER_SPECIALS = {"bos": 256, "eos": 257, "pad": 258}

#: The four norms of every Gemma decoder layer (attention and feed-forward, before and after).
_LAYER_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)

_DTYPES: dict[str, Any] = {
    "bfloat16": ml_dtypes.bfloat16,
    "float32": np.float32,
    "float16": np.float16,
}


def _layer_types(num_layers: int, pattern: int) -> list[str]:
    """Gemma's interleaving: every ``pattern``-th layer global, the others sliding."""
    return [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
        for i in range(num_layers)
    ]


def gemma3_text_config(
    *,
    vocab_size: int = 272,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_hidden_layers: int = 4,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    sliding_window: int = 8,
    sliding_window_pattern: int = 2,
    max_position_embeddings: int = 256,
    query_pre_attn_scalar: float = 16,
    rope_theta: float = 1_000_000.0,
    rope_local_base_freq: float = 10_000.0,
    attn_logit_softcapping: float | None = None,
    final_logit_softcapping: float | None = None,
    rms_norm_eps: float = 1e-6,
    bos_token_id: int = 2,
    eos_token_id: int = 1,
    pad_token_id: int = 0,
) -> dict[str, Any]:
    """The ``text_config`` of a Gemma 3 model, as ``Gemma3TextConfig(...).to_dict()`` gives it.

    The defaults are the tiny model; ``query_pre_attn_scalar`` is ``head_dim`` (Gemma 3 1B
    has 256 = its ``head_dim``).
    """
    return {
        "_sliding_window_pattern": sliding_window_pattern,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_logit_softcapping": attn_logit_softcapping,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "final_logit_softcapping": final_logit_softcapping,
        "head_dim": head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": intermediate_size,
        "layer_types": _layer_types(num_hidden_layers, sliding_window_pattern),
        "max_position_embeddings": max_position_embeddings,
        "model_type": "gemma3_text",
        "num_attention_heads": num_attention_heads,
        "num_hidden_layers": num_hidden_layers,
        "num_key_value_heads": num_key_value_heads,
        "pad_token_id": pad_token_id,
        "query_pre_attn_scalar": query_pre_attn_scalar,
        "rms_norm_eps": rms_norm_eps,
        "rope_parameters": {
            "full_attention": {"rope_theta": float(rope_theta), "rope_type": "default"},
            "sliding_attention": {
                "rope_theta": float(rope_local_base_freq),
                "rope_type": "default",
            },
        },
        "sliding_window": sliding_window,
        "sliding_window_pattern": sliding_window_pattern,
        "tie_word_embeddings": True,
        "use_bidirectional_attention": False,
        "use_cache": True,
        "vocab_size": vocab_size,
    }


def gemma3_conditional_config(text_config: Mapping[str, Any]) -> dict[str, Any]:
    """The ``config.json`` of ``Gemma3ForConditionalGeneration`` around ``text_config``
    (a one-layer SigLIP vision config; no vision weights are written)."""
    return {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "boi_token_index": 255999,
        "dtype": "bfloat16",
        "eoi_token_index": 256000,
        "image_token_index": 262144,
        "initializer_range": 0.02,
        "mm_tokens_per_image": 4,
        "model_type": "gemma3",
        "text_config": dict(text_config),
        "tie_word_embeddings": True,
        "transformers_version": TRANSFORMERS_VERSION,
        "vision_config": {
            "attention_dropout": 0.0,
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_size": 32,
            "image_size": 28,
            "intermediate_size": 64,
            "layer_norm_eps": 1e-06,
            "model_type": "siglip_vision_model",
            "num_attention_heads": 2,
            "num_channels": 3,
            "num_hidden_layers": 1,
            "patch_size": 14,
        },
    }


def gemma4_config(
    *,
    vocab_size: int = 272,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_hidden_layers: int = 4,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    global_head_dim: int = 32,
    num_global_key_value_heads: int | None = 1,
    attention_k_eq_v: bool = True,
    sliding_window: int = 8,
    sliding_window_pattern: int = 2,
    max_position_embeddings: int = 256,
    final_logit_softcapping: float | None = None,
    rms_norm_eps: float = 1e-6,
) -> dict[str, Any]:
    """The ``config.json`` of ``Gemma4ForConditionalGeneration`` (dense text decoder, no MoE,
    no per-layer inputs, as Gemma 4 31B), with a one-layer vision config.

    ``global_head_dim=head_dim``, ``num_global_key_value_heads=None`` and
    ``attention_k_eq_v=False`` give uniform layers.
    """
    text = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attention_k_eq_v": attention_k_eq_v,
        "bos_token_id": 2,
        "enable_moe_block": False,
        "eos_token_id": 1,
        "final_logit_softcapping": final_logit_softcapping,
        "global_head_dim": global_head_dim,
        "head_dim": head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": hidden_size,
        "hidden_size_per_layer_input": 0,
        "initializer_range": 0.02,
        "intermediate_size": intermediate_size,
        "layer_types": _layer_types(num_hidden_layers, sliding_window_pattern),
        "max_position_embeddings": max_position_embeddings,
        "model_type": "gemma4_text",
        "moe_intermediate_size": None,
        "num_attention_heads": num_attention_heads,
        "num_experts": None,
        "num_global_key_value_heads": num_global_key_value_heads,
        "num_hidden_layers": num_hidden_layers,
        "num_key_value_heads": num_key_value_heads,
        "num_kv_shared_layers": 0,
        "pad_token_id": 0,
        "rms_norm_eps": rms_norm_eps,
        "rope_parameters": {
            "full_attention": {
                "partial_rotary_factor": 0.25,
                "rope_theta": 1000000.0,
                "rope_type": "proportional",
            },
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        },
        "sliding_window": sliding_window,
        "tie_word_embeddings": True,
        "top_k_experts": None,
        "use_bidirectional_attention": None,
        "use_cache": True,
        "use_double_wide_mlp": False,
        "vocab_size": vocab_size,
        "vocab_size_per_layer_input": vocab_size,
    }
    return {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "audio_config": None,
        "audio_token_id": 258881,
        "boa_token_id": 256000,
        "boi_token_id": 255999,
        "dtype": "bfloat16",
        "eoa_token_index": 258883,
        "eoi_token_id": 258882,
        "image_token_id": 258880,
        "initializer_range": 0.02,
        "model_type": "gemma4",
        "text_config": text,
        "tie_word_embeddings": True,
        "transformers_version": TRANSFORMERS_VERSION,
        "video_token_id": 258884,
        "vision_config": {
            "attention_bias": False,
            "attention_dropout": 0.0,
            "head_dim": 16,
            "hidden_activation": "gelu_pytorch_tanh",
            "hidden_size": 32,
            "initializer_range": 0.02,
            "intermediate_size": 64,
            "max_position_embeddings": 131072,
            "model_type": "gemma4_vision",
            "num_attention_heads": 2,
            "num_hidden_layers": 1,
            "num_key_value_heads": 2,
            "patch_size": 16,
            "pooling_kernel_size": 3,
            "position_embedding_size": 10240,
            "rms_norm_eps": 1e-06,
            "rope_parameters": {"rope_theta": 100.0, "rope_type": "default"},
            "standardize": False,
            "use_clipped_linears": False,
        },
    }


def _stack(
    rng: np.random.Generator, shape: tuple[int, int], layers: list[int], noise: float = 0.5
) -> dict[int, np.ndarray]:
    """One weight per layer in ``layers``: a shared part plus per-layer noise, std ``1/sqrt(in)``."""
    base = rng.standard_normal(shape)
    scale = shape[1] ** -0.5 / np.sqrt(1.0 + noise**2)
    return {i: scale * (base + noise * rng.standard_normal(shape)) for i in layers}


def _norm(rng: np.random.Generator, dim: int, *, offset: float) -> np.ndarray:
    """A norm weight near ``offset`` (``0`` for Gemma 3's ``1 + w`` form, ``1`` for Gemma 4's)."""
    return offset + 0.1 * rng.standard_normal(dim)


def gemma3_text_tensors(
    text_config: Mapping[str, Any], *, seed: int = 0, prefix: str = "model"
) -> dict[str, np.ndarray]:
    """Float64 weights of a Gemma 3 text decoder under ``{prefix}.`` (Hugging Face names).

    ``prefix`` is ``model`` for ``Gemma3ForCausalLM`` and ``language_model.model`` for the
    text part of ``Gemma3ForConditionalGeneration``. Embeddings are tied: no ``lm_head``.
    """
    c = text_config
    rng = np.random.default_rng(seed)
    L, H, D = c["num_hidden_layers"], c["hidden_size"], c["head_dim"]
    q, kv, ff = c["num_attention_heads"] * D, c["num_key_value_heads"] * D, c["intermediate_size"]
    layers = list(range(L))
    tensors = {f"{prefix}.embed_tokens.weight": rng.normal(0.0, H**-0.5, (c["vocab_size"], H))}
    shapes = {
        "self_attn.q_proj": (q, H),
        "self_attn.k_proj": (kv, H),
        "self_attn.v_proj": (kv, H),
        "self_attn.o_proj": (H, q),
        "mlp.gate_proj": (ff, H),
        "mlp.up_proj": (ff, H),
        "mlp.down_proj": (H, ff),
    }
    for family, shape in shapes.items():
        for i, w in _stack(rng, shape, layers).items():
            tensors[f"{prefix}.layers.{i}.{family}.weight"] = w
    for i in layers:
        p = f"{prefix}.layers.{i}."
        for norm in _LAYER_NORMS:
            tensors[p + norm + ".weight"] = _norm(rng, H, offset=0.0)
        tensors[p + "self_attn.q_norm.weight"] = _norm(rng, D, offset=0.0)
        tensors[p + "self_attn.k_norm.weight"] = _norm(rng, D, offset=0.0)
    tensors[f"{prefix}.norm.weight"] = _norm(rng, H, offset=0.0)
    return dict(sorted(tensors.items()))


def gemma4_text_tensors(
    config: Mapping[str, Any], *, seed: int = 0, prefix: str = "model.language_model"
) -> dict[str, np.ndarray]:
    """Float64 weights of a Gemma 4 text decoder (``config`` is the whole model's config).

    Global layers (``full_attention``) have ``global_head_dim`` and
    ``num_global_key_value_heads`` and, with ``attention_k_eq_v``, no ``v_proj``; every layer
    has a ``layer_scalar`` ``[1]``. Gemma 4's norms multiply by ``w`` (not ``1 + w``).
    """
    c = config["text_config"]
    rng = np.random.default_rng(seed)
    L, H, ff = c["num_hidden_layers"], c["hidden_size"], c["intermediate_size"]
    heads = c["num_attention_heads"]
    layer_types = c["layer_types"]
    tensors = {f"{prefix}.embed_tokens.weight": rng.normal(0.0, H**-0.5, (c["vocab_size"], H))}
    by_type: dict[str, list[int]] = {}
    for i, kind in enumerate(layer_types):
        by_type.setdefault(kind, []).append(i)
    for kind, layers in by_type.items():
        glob = kind == "full_attention"
        D = c["global_head_dim"] if glob and c["global_head_dim"] else c["head_dim"]
        k_eq_v = glob and c["attention_k_eq_v"]
        kv_heads = c["num_global_key_value_heads"] if k_eq_v else c["num_key_value_heads"]
        shapes = {
            "self_attn.q_proj": (heads * D, H),
            "self_attn.k_proj": (kv_heads * D, H),
            "self_attn.o_proj": (H, heads * D),
        }
        if not k_eq_v:
            shapes["self_attn.v_proj"] = (kv_heads * D, H)
        for family, shape in shapes.items():
            for i, w in _stack(rng, shape, layers).items():
                tensors[f"{prefix}.layers.{i}.{family}.weight"] = w
        for i in layers:
            tensors[f"{prefix}.layers.{i}.self_attn.q_norm.weight"] = _norm(rng, D, offset=1.0)
            tensors[f"{prefix}.layers.{i}.self_attn.k_norm.weight"] = _norm(rng, D, offset=1.0)
    for family, shape in {
        "mlp.gate_proj": (ff, H),
        "mlp.up_proj": (ff, H),
        "mlp.down_proj": (H, ff),
    }.items():
        for i, w in _stack(rng, shape, list(range(L))).items():
            tensors[f"{prefix}.layers.{i}.{family}.weight"] = w
    for i in range(L):
        p = f"{prefix}.layers.{i}."
        for norm in _LAYER_NORMS:
            tensors[p + norm + ".weight"] = _norm(rng, H, offset=1.0)
        tensors[p + "layer_scalar"] = np.ones(1)
    tensors[f"{prefix}.norm.weight"] = _norm(rng, H, offset=1.0)
    return dict(sorted(tensors.items()))


def _write(
    directory: Path,
    config: dict[str, Any],
    tensors: Mapping[str, np.ndarray],
    *,
    dtype: str,
    tokenizer: bool,
) -> Path:
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}: choose one of {sorted(_DTYPES)}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    np_dtype = _DTYPES[dtype]
    # Cast through float32 (as torch does for bf16) and write C-contiguous arrays only.
    arrays = {
        key: np.ascontiguousarray(np.asarray(value, np.float32).astype(np_dtype))
        for key, value in tensors.items()
    }
    safetensors.numpy.save_file(arrays, directory / "model.safetensors", metadata={"format": "pt"})
    config = dict(config)
    config["dtype"] = dtype
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if tokenizer:
        _write_tokenizer(directory, config)
    return directory


def _write_tokenizer(directory: Path, config: Mapping[str, Any]) -> None:
    """A byte-level BPE with no merges (one token per byte), specials up to the vocabulary."""
    text = config.get("text_config", config)
    vocab = text["vocab_size"]
    if vocab < 259:
        raise ValueError(
            f"tokenizer=True needs vocab_size >= 259 (256 bytes + 3 specials): {vocab}"
        )
    specials = ["<bos>", "<eos>", "<pad>"] + [f"<extra_{i}>" for i in range(vocab - 259)]
    write_byte_tokenizer(
        directory,
        specials,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        model_max_length=int(text["max_position_embeddings"]),
    )


def _token_ids(tokenizer: bool) -> dict[str, int]:
    if not tokenizer:
        return {}
    return {f"{name}_token_id": i for name, i in _TOKENIZER_SPECIALS.items()}


def write_tiny_gemma3(
    directory: str | Path,
    *,
    seed: int = 0,
    dtype: str = "bfloat16",
    tokenizer: bool = False,
    **config_fields: Any,
) -> Path:
    """Write a tiny ``Gemma3ForCausalLM`` checkpoint to ``directory`` and return it.

    Parameters
    ----------
    directory : path
        Created if missing; ``config.json`` and ``model.safetensors`` are (over)written.
    seed : int
        Fixes the weights.
    dtype : {"bfloat16", "float32", "float16"}
        Storage dtype of every tensor (and ``config.json``'s ``dtype``).
    tokenizer : bool
        Also write a byte-level ``tokenizer.json`` (needs ``tokenizers``); the config's
        bos/eos/pad ids then point at its specials (256, 257, 258).
    **config_fields
        Keyword arguments of :func:`gemma3_text_config` (sizes, softcapping, window...).
    """
    text = gemma3_text_config(**{**_token_ids(tokenizer), **config_fields})
    config = {
        "architectures": ["Gemma3ForCausalLM"],
        **text,
        "transformers_version": TRANSFORMERS_VERSION,
    }
    tensors = gemma3_text_tensors(text, seed=seed, prefix="model")
    return _write(Path(directory), config, tensors, dtype=dtype, tokenizer=tokenizer)


def write_tiny_gemma3_conditional(
    directory: str | Path,
    *,
    seed: int = 0,
    dtype: str = "bfloat16",
    tokenizer: bool = False,
    **config_fields: Any,
) -> Path:
    """Write the text part of a tiny ``Gemma3ForConditionalGeneration`` (keys
    ``language_model.model.*``) to ``directory``; arguments as :func:`write_tiny_gemma3`.

    The same seed gives the same text weights as :func:`write_tiny_gemma3`.
    """
    text = gemma3_text_config(**{**_token_ids(tokenizer), **config_fields})
    tensors = gemma3_text_tensors(text, seed=seed, prefix="language_model.model")
    return _write(
        Path(directory),
        gemma3_conditional_config(text),
        tensors,
        dtype=dtype,
        tokenizer=tokenizer,
    )


def write_tiny_gemma4(
    directory: str | Path,
    *,
    seed: int = 0,
    dtype: str = "bfloat16",
    tokenizer: bool = False,
    **config_fields: Any,
) -> Path:
    """Write the text decoder of a tiny ``Gemma4ForConditionalGeneration`` (keys
    ``model.language_model.*``) to ``directory``; ``config_fields`` go to
    :func:`gemma4_config`. No vision tower weights are written."""
    config = gemma4_config(**config_fields)
    if tokenizer:
        config["text_config"].update(_token_ids(True))
    tensors = gemma4_text_tensors(config, seed=seed)
    return _write(Path(directory), config, tensors, dtype=dtype, tokenizer=tokenizer)
