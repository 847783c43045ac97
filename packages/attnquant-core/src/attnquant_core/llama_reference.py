"""An exact numpy forward of a Hugging Face Llama decoder: a reference for tests and analysis.

This is not a serving path: it recomputes the whole prompt at every call (no KV cache), holds
every activation, and is written to be read against ``transformers``' ``modeling_llama.py``.
What it follows, on purpose:

* RMSNorm ``w * x / sqrt(mean(x^2) + eps)``; SiLU-gated MLP ``down(silu(gate x) * up x)``;
* rotary embeddings in the Hugging Face ``rotate_half`` convention (dimension ``i`` pairs with
  ``i + head_dim/2``), ``rope_scaling`` of type none/default, ``linear`` or ``llama3``;
* causal softmax attention with grouped-query heads (query head ``h`` reads KV head
  ``h // (num_heads / num_kv_heads)``, as ``repeat_kv`` does), scaled by ``1/sqrt(head_dim)``;
* projection biases when the state holds them (``attention_bias``/``mlp_bias``), and per-head
  ``self_attn.q_norm``/``k_norm`` RMSNorms before the rotation (Qwen3 style) when present;
* ``lm_head.weight``, or the embedding when ``tie_word_embeddings`` is set and it is absent.

Everything is computed in the ``dtype`` asked for (float64 by default), whatever the stored
dtype of the weights.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
from scipy.special import expit

from ._errors import AttnquantError

__all__ = ["ReferenceConfigError", "llama_logits", "rope_inv_freq"]


class ReferenceConfigError(AttnquantError, ValueError):
    """The config or the weights are outside what the reference forward implements."""


def _field(config: Mapping, name: str) -> object:
    if name not in config or config[name] is None:
        raise ReferenceConfigError(f"config has no {name!r}; the Llama reference forward needs it")
    return config[name]


def rope_inv_freq(config: Mapping, head_dim: int) -> np.ndarray:
    """Inverse frequencies of the rotary planes, ``[head_dim/2]``, after ``rope_scaling``."""
    base = float(config.get("rope_theta", 10000.0))
    inv_freq = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    scaling = config.get("rope_scaling")
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled)
    raise ReferenceConfigError(
        f"rope_scaling type {kind!r} is not implemented by the reference forward "
        f"(none, 'default', 'linear' and 'llama3' are)"
    )


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return weight * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def _rotate_half(x: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def llama_logits(
    config: Mapping,
    state: Mapping[str, np.ndarray],
    ids: Sequence[int],
    *,
    dtype: np.dtype | type = np.float64,
    prefix: str = "model",
) -> np.ndarray:
    """Logits ``[T, vocab]`` of a Llama decoder for one prompt of token ``ids``, in numpy.

    Parameters
    ----------
    config : mapping
        The checkpoint's ``config.json`` (``hidden_size``, ``num_attention_heads``,
        ``num_key_value_heads``, optional ``head_dim``, ``rms_norm_eps``, ``rope_theta``,
        ``rope_scaling``, ``tie_word_embeddings``, ``hidden_act``).
    state : mapping of str to ndarray
        Every tensor under its Hugging Face key (``model.layers.0.self_attn.q_proj.weight`` ...),
        any float dtype (bfloat16 included).
    ids : sequence of int
        The prompt; position ``t`` is ``t``.
    dtype : dtype, default=float64
        The compute dtype (float64 for a tight reference, float32 to mimic a float32 model).
    prefix : str, default="model"
        Key prefix of the embedding, the layer stack and the final norm.
    """
    dt = np.dtype(dtype)
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ReferenceConfigError(
            f"hidden_act={act!r}: the reference forward implements silu only"
        )
    if config.get("partial_rotary_factor", 1.0) != 1.0:
        raise ReferenceConfigError("partial_rotary_factor != 1 is not implemented by the reference")
    hidden = int(_field(config, "hidden_size"))
    n_heads = int(_field(config, "num_attention_heads"))
    n_kv = int(config.get("num_key_value_heads") or n_heads)
    head_dim = int(config.get("head_dim") or hidden // n_heads)
    eps = float(config.get("rms_norm_eps", 1e-6))
    if n_heads % n_kv:
        raise ReferenceConfigError(f"num_attention_heads={n_heads} is not a multiple of kv={n_kv}")
    if head_dim % 2:
        raise ReferenceConfigError(f"head_dim={head_dim} is odd; rotary embeddings need pairs")
    n_rep = n_heads // n_kv

    def get(key: str) -> np.ndarray:
        if key not in state:
            raise ReferenceConfigError(f"state has no {key!r}")
        return np.asarray(state[key], dtype=dt)

    def linear(x: np.ndarray, key: str) -> np.ndarray:
        y = x @ get(f"{key}.weight").T
        bias = f"{key}.bias"
        return y + get(bias) if bias in state else y

    ids = np.asarray(ids, dtype=np.int64)
    if ids.ndim != 1 or not len(ids):
        raise ReferenceConfigError("ids must be a non-empty 1-D sequence of token ids")
    T = len(ids)
    embed = get(f"{prefix}.embed_tokens.weight")
    if ids.min() < 0 or ids.max() >= embed.shape[0]:
        raise ReferenceConfigError(f"token ids outside 0..{embed.shape[0] - 1}")
    h = embed[ids]

    angles = np.arange(T, dtype=np.float64)[:, None] * rope_inv_freq(config, head_dim)[None]
    angles = np.concatenate([angles, angles], axis=-1)  # [T, head_dim], rotate_half layout
    cos, sin = np.cos(angles).astype(dt), np.sin(angles).astype(dt)
    causal = np.triu(np.ones((T, T), dtype=bool), k=1)
    scale = dt.type(1.0 / math.sqrt(head_dim))

    num_layers = int(config.get("num_hidden_layers") or 0)
    if not num_layers:
        while f"{prefix}.layers.{num_layers}.input_layernorm.weight" in state:
            num_layers += 1
    for i in range(num_layers):
        p = f"{prefix}.layers.{i}"
        x = _rms_norm(h, get(f"{p}.input_layernorm.weight"), eps)
        q = linear(x, f"{p}.self_attn.q_proj").reshape(T, n_heads, head_dim).transpose(1, 0, 2)
        k = linear(x, f"{p}.self_attn.k_proj").reshape(T, n_kv, head_dim).transpose(1, 0, 2)
        v = linear(x, f"{p}.self_attn.v_proj").reshape(T, n_kv, head_dim).transpose(1, 0, 2)
        if f"{p}.self_attn.q_norm.weight" in state:
            q = _rms_norm(q, get(f"{p}.self_attn.q_norm.weight"), eps)
        if f"{p}.self_attn.k_norm.weight" in state:
            k = _rms_norm(k, get(f"{p}.self_attn.k_norm.weight"), eps)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k = np.repeat(k, n_rep, axis=0)  # [n_heads, T, d]: head h reads kv head h // n_rep
        v = np.repeat(v, n_rep, axis=0)
        scores = (q @ k.transpose(0, 2, 1)) * scale
        scores[:, causal] = -np.inf
        scores -= scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        attn = (probs @ v).transpose(1, 0, 2).reshape(T, n_heads * head_dim)
        h = h + linear(attn, f"{p}.self_attn.o_proj")
        x = _rms_norm(h, get(f"{p}.post_attention_layernorm.weight"), eps)
        gate = linear(x, f"{p}.mlp.gate_proj")
        silu = gate * expit(gate)
        h = h + linear(silu * linear(x, f"{p}.mlp.up_proj"), f"{p}.mlp.down_proj")
    h = _rms_norm(h, get(f"{prefix}.norm.weight"), eps)
    if "lm_head.weight" in state:
        head = get("lm_head.weight")
    elif config.get("tie_word_embeddings", False):
        head = embed
    else:
        raise ReferenceConfigError(
            "state has no 'lm_head.weight' and tie_word_embeddings is not set"
        )
    return h @ head.T
