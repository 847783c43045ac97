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

The config dicts are made in :mod:`attnquant_core._tiny_gemma_config` and re-exported here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import safetensors.numpy

from ._tiny_gemma_config import (
    TRANSFORMERS_VERSION,
    gemma3_conditional_config,
    gemma3_text_config,
    gemma4_config,
)
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
