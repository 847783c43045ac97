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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.special import expit

from ._errors import AttnquantError

__all__ = [
    "LlamaSpec",
    "ReferenceConfigError",
    "llama_head",
    "llama_layer",
    "llama_logits",
    "llama_spec",
    "num_layers",
    "rope_inv_freq",
    "rope_tables",
]

#: ``capture(projections, x)`` receives the input ``x [..., in]`` of the named projections of
#: one layer (``("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")`` share one).
Capture = Callable[[tuple[str, ...], np.ndarray], None]
#: ``get(key)`` returns the tensor stored under a Hugging Face key.
Getter = Callable[[str], np.ndarray]


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


def _linear(get: Getter, has_key: Callable[[str], bool]) -> Callable[[np.ndarray, str], np.ndarray]:
    """``linear(x, key)``: ``x W^T`` of ``key.weight``, plus ``key.bias`` when the state has one."""

    def linear(x: np.ndarray, key: str) -> np.ndarray:
        y = x @ get(f"{key}.weight").T
        bias = f"{key}.bias"
        return y + get(bias) if has_key(bias) else y

    return linear


def _attend(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    *,
    n_rep: int,
    scale: float,
    mask: np.ndarray,
    softcap: Callable[[np.ndarray], np.ndarray] | None = None,
) -> np.ndarray:
    """Rotary on ``q``/``k`` (``[..., heads, T, d]``), grouped-query softmax attention with the
    additive ``mask [T, T]`` (after ``softcap`` of the scaled scores, when given); returns the
    heads merged, ``[..., T, heads * d]``."""
    dt = q.dtype
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    k = np.repeat(k, n_rep, axis=-3)  # head h reads kv head h // n_rep
    v = np.repeat(v, n_rep, axis=-3)
    scores = q @ np.swapaxes(k, -1, -2)
    scores *= dt.type(scale)
    if softcap is not None:
        scores = softcap(scores)
    scores += mask
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores, out=scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    out = probs @ v
    *lead, heads, T, d = out.shape
    return np.swapaxes(out, -3, -2).reshape(*lead, T, heads * d)


@dataclass(frozen=True, kw_only=True)
class LlamaSpec:
    """The dimensions a Llama decoder layer needs, read and checked from ``config.json``."""

    hidden: int
    n_heads: int
    n_kv: int
    head_dim: int
    eps: float

    @property
    def n_rep(self) -> int:
        return self.n_heads // self.n_kv


def llama_spec(config: Mapping) -> LlamaSpec:
    """Check ``config`` is one the reference implements and return its layer dimensions."""
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
    return LlamaSpec(hidden=hidden, n_heads=n_heads, n_kv=n_kv, head_dim=head_dim, eps=eps)


def num_layers(config: Mapping, has_key: Callable[[str], bool], prefix: str = "model") -> int:
    """``num_hidden_layers``, else the count of consecutive layers whose input norm is stored."""
    count = int(config.get("num_hidden_layers") or 0)
    if not count:
        while has_key(f"{prefix}.layers.{count}.input_layernorm.weight"):
            count += 1
    return count


def rope_tables(
    config: Mapping, spec: LlamaSpec, length: int, dtype: np.dtype | type = np.float64
) -> tuple[np.ndarray, np.ndarray]:
    """``cos, sin`` ``[length, head_dim]`` for positions ``0..length-1`` (rotate_half layout)."""
    angles = (
        np.arange(length, dtype=np.float64)[:, None] * rope_inv_freq(config, spec.head_dim)[None]
    )
    angles = np.concatenate([angles, angles], axis=-1)
    return np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)


def llama_layer(
    spec: LlamaSpec,
    get: Getter,
    has_key: Callable[[str], bool],
    layer_prefix: str,
    h: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    *,
    capture: Capture | None = None,
) -> np.ndarray:
    """One decoder layer on hidden states ``h [..., T, hidden]`` (a batch of equal-length
    sequences, positions ``0..T-1``); returns the new hidden states.

    ``get`` returns a tensor already in the compute dtype; ``capture``, when given, sees the
    input of each projection (see :data:`Capture`).
    """
    p = layer_prefix
    T = h.shape[-2]
    lead = h.shape[:-2]
    linear = _linear(get, has_key)

    def heads(x: np.ndarray, n: int) -> np.ndarray:  # [..., T, n*d] -> [..., n, T, d]
        return np.swapaxes(x.reshape(*lead, T, n, spec.head_dim), -3, -2)

    x = _rms_norm(h, get(f"{p}.input_layernorm.weight"), spec.eps)
    if capture is not None:
        capture(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), x)
    q = heads(linear(x, f"{p}.self_attn.q_proj"), spec.n_heads)
    k = heads(linear(x, f"{p}.self_attn.k_proj"), spec.n_kv)
    v = heads(linear(x, f"{p}.self_attn.v_proj"), spec.n_kv)
    if has_key(f"{p}.self_attn.q_norm.weight"):
        q = _rms_norm(q, get(f"{p}.self_attn.q_norm.weight"), spec.eps)
    if has_key(f"{p}.self_attn.k_norm.weight"):
        k = _rms_norm(k, get(f"{p}.self_attn.k_norm.weight"), spec.eps)
    causal = np.triu(np.full((T, T), -np.inf, dtype=h.dtype), k=1)  # -inf above the diagonal
    attn = _attend(
        q, k, v, cos, sin, n_rep=spec.n_rep, scale=1.0 / math.sqrt(spec.head_dim), mask=causal
    )
    del q, k, v
    if capture is not None:
        capture(("self_attn.o_proj",), attn)
    h = h + linear(attn, f"{p}.self_attn.o_proj")
    x = _rms_norm(h, get(f"{p}.post_attention_layernorm.weight"), spec.eps)
    if capture is not None:
        capture(("mlp.gate_proj", "mlp.up_proj"), x)
    gate = linear(x, f"{p}.mlp.gate_proj")
    inner = gate * expit(gate) * linear(x, f"{p}.mlp.up_proj")
    del gate
    if capture is not None:
        capture(("mlp.down_proj",), inner)
    return h + linear(inner, f"{p}.mlp.down_proj")


def llama_head(
    config: Mapping, get: Getter, has_key: Callable[[str], bool], prefix: str = "model"
) -> tuple[np.ndarray, np.ndarray]:
    """``(final norm weight, output head [vocab, hidden])``: ``lm_head``, or the tied embedding."""
    if has_key("lm_head.weight"):
        head = get("lm_head.weight")
    elif config.get("tie_word_embeddings", False):
        head = get(f"{prefix}.embed_tokens.weight")
    else:
        raise ReferenceConfigError(
            "state has no 'lm_head.weight' and tie_word_embeddings is not set"
        )
    return get(f"{prefix}.norm.weight"), head


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
    spec = llama_spec(config)

    def get(key: str) -> np.ndarray:
        if key not in state:
            raise ReferenceConfigError(f"state has no {key!r}")
        return np.asarray(state[key], dtype=dt)

    def has_key(key: str) -> bool:
        return key in state

    ids = np.asarray(ids, dtype=np.int64)
    if ids.ndim != 1 or not len(ids):
        raise ReferenceConfigError("ids must be a non-empty 1-D sequence of token ids")
    embed = get(f"{prefix}.embed_tokens.weight")
    if ids.min() < 0 or ids.max() >= embed.shape[0]:
        raise ReferenceConfigError(f"token ids outside 0..{embed.shape[0] - 1}")
    h = embed[ids]
    cos, sin = rope_tables(config, spec, len(ids), dt)
    for i in range(num_layers(config, has_key, prefix)):
        h = llama_layer(spec, get, has_key, f"{prefix}.layers.{i}", h, cos, sin)
    norm, head = llama_head(config, get, has_key, prefix)
    return _rms_norm(h, norm, spec.eps) @ head.T
