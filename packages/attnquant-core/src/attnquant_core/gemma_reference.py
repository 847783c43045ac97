"""An exact numpy forward of a Hugging Face Gemma 3 text decoder: a reference for tests and analysis.

The Gemma counterpart of :mod:`attnquant_core.llama_reference`, written to be read against
``transformers``' ``modeling_gemma3.py``. Not a serving path: it recomputes the whole prompt at
every call and holds every activation. What it follows, on purpose:

* the token embedding scaled by ``sqrt(hidden_size)``, the scale rounded to the compute dtype
  first (``Gemma3TextScaledWordEmbedding`` casts it to the weight's dtype: 34.0 rather than
  33.94 for Gemma 3 1B in bfloat16);
* Gemma's RMSNorm ``x / sqrt(mean(x^2) + eps) * (1 + w)``, for the four norms of each layer
  (input, post-attention, pre- and post-feed-forward), the per-head ``q_norm``/``k_norm``
  before the rotation, and the final norm;
* the MLP ``down(gelu_tanh(gate x) * up x)`` (``gelu_pytorch_tanh``);
* attention scaled by ``query_pre_attn_scalar ** -0.5``, grouped-query heads as ``repeat_kv``,
  optional ``attn_logit_softcapping`` (``cap * tanh(scores / cap)`` before the mask);
* sliding-window layers (``layer_types``, or ``sliding_window_pattern`` for older configs)
  see keys ``k`` with ``q - sliding_window < k <= q`` and rotate with
  ``rope_local_base_freq``; global layers see every earlier key and rotate with
  ``rope_theta`` and its ``rope_scaling`` (``rope_parameters`` of transformers 5 read too);
* tied embeddings (``lm_head.weight`` used when present) and optional
  ``final_logit_softcapping``.

Everything is computed in the ``dtype`` asked for (float64 by default), whatever the stored
dtype of the weights. ``config`` may be a ``Gemma3ForCausalLM`` config or a
``Gemma3ForConditionalGeneration`` one (its ``text_config`` is used).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .llama_reference import ReferenceConfigError, _rms_norm, _rotate_half, rope_inv_freq

__all__ = ["gemma3_layer_types", "gemma3_logits", "gemma3_rope_configs", "gelu_tanh"]


def _field(config: Mapping, name: str) -> Any:
    if name not in config or config[name] is None:
        raise ReferenceConfigError(f"config has no {name!r}; the Gemma reference forward needs it")
    return config[name]


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """``gelu_pytorch_tanh``: ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``."""
    c = x.dtype.type(math.sqrt(2.0 / math.pi))
    return 0.5 * x * (1.0 + np.tanh(c * (x + x.dtype.type(0.044715) * x**3)))


def gemma3_layer_types(config: Mapping) -> list[str]:
    """``"sliding_attention"`` or ``"full_attention"`` per layer, from ``layer_types`` or,
    for configs without it, ``sliding_window_pattern`` (every ``pattern``-th layer global)."""
    config = config.get("text_config", config)
    n = int(_field(config, "num_hidden_layers"))
    types = config.get("layer_types")
    if types is not None:
        if len(types) != n:
            raise ReferenceConfigError(f"layer_types has {len(types)} entries for {n} layers")
        bad = sorted(set(types) - {"sliding_attention", "full_attention"})
        if bad:
            raise ReferenceConfigError(f"layer_types {bad} are not implemented by the reference")
        return list(types)
    pattern = int(
        config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or 6
    )
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]


def gemma3_rope_configs(config: Mapping) -> dict[str, dict[str, Any]]:
    """``{layer type: {"rope_theta", "rope_scaling"}}`` in the form :func:`rope_inv_freq` reads.

    transformers 5 nests them in ``rope_parameters``; 4.x has ``rope_theta``, ``rope_scaling``
    (global layers) and ``rope_local_base_freq`` (sliding layers, never scaled).
    """
    config = config.get("text_config", config)
    params = config.get("rope_parameters")
    if isinstance(params, Mapping) and "full_attention" in params:
        out = {}
        for kind in ("full_attention", "sliding_attention"):
            p = dict(params[kind])
            out[kind] = {"rope_theta": float(p.get("rope_theta", 10000.0)), "rope_scaling": p}
        return out
    return {
        "full_attention": {
            "rope_theta": float(config.get("rope_theta", 1_000_000.0)),
            "rope_scaling": config.get("rope_scaling"),
        },
        "sliding_attention": {
            "rope_theta": float(config.get("rope_local_base_freq", 10_000.0)),
            "rope_scaling": None,
        },
    }


def _gemma_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return _rms_norm(x, 1.0 + weight, eps)


def _softcap(x: np.ndarray, cap: float | None) -> np.ndarray:
    if not cap:
        return x
    cap = x.dtype.type(cap)
    return cap * np.tanh(x / cap)


def _stack_prefix(state: Mapping[str, Any]) -> str:
    for prefix in ("model", "language_model.model", "model.language_model"):
        if f"{prefix}.embed_tokens.weight" in state:
            return prefix
    raise ReferenceConfigError(
        "state has no '<prefix>.embed_tokens.weight' under model., language_model.model. or "
        "model.language_model.; pass prefix="
    )


def gemma3_logits(
    config: Mapping,
    state: Mapping[str, np.ndarray],
    ids: Sequence[int],
    *,
    dtype: np.dtype | type = np.float64,
    prefix: str | None = None,
    embed_scale_dtype: np.dtype | type | None = None,
) -> np.ndarray:
    """Logits ``[T, vocab]`` of a Gemma 3 text decoder for one prompt of token ``ids``.

    Parameters
    ----------
    config : mapping
        The checkpoint's ``config.json`` (its ``text_config`` if it has one).
    state : mapping of str to ndarray
        Every tensor under its Hugging Face key, any float dtype (bfloat16 included).
    ids : sequence of int
        The prompt; position ``t`` is ``t``.
    dtype : dtype, default=float64
        The compute dtype.
    prefix : str, optional
        Key prefix of the embedding, layers and final norm; found from ``state`` by default
        (``model``, ``language_model.model`` or ``model.language_model``).
    embed_scale_dtype : dtype, optional
        The dtype ``sqrt(hidden_size)`` is rounded to before scaling the embedding; ``dtype``
        by default. Pass the checkpoint's dtype (bfloat16) to follow ``transformers`` running
        the model in that dtype.

    Returns
    -------
    logits : ndarray of shape (T, vocab_size), dtype ``dtype``
    """
    dt = np.dtype(dtype)
    text = config.get("text_config", config)
    act = text.get("hidden_activation", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ReferenceConfigError(
            f"hidden_activation={act!r}: the Gemma reference implements gelu_pytorch_tanh only"
        )
    hidden = int(_field(text, "hidden_size"))
    n_heads = int(_field(text, "num_attention_heads"))
    n_kv = int(text.get("num_key_value_heads") or n_heads)
    head_dim = int(text.get("head_dim") or hidden // n_heads)
    eps = float(text.get("rms_norm_eps", 1e-6))
    if n_heads % n_kv:
        raise ReferenceConfigError(f"num_attention_heads={n_heads} is not a multiple of kv={n_kv}")
    if head_dim % 2:
        raise ReferenceConfigError(f"head_dim={head_dim} is odd; rotary embeddings need pairs")
    n_rep = n_heads // n_kv
    scale = dt.type(float(text.get("query_pre_attn_scalar") or head_dim) ** -0.5)
    attn_cap = text.get("attn_logit_softcapping")
    final_cap = text.get("final_logit_softcapping")
    window = int(text.get("sliding_window") or 0)
    layer_types = gemma3_layer_types(text)
    rope = gemma3_rope_configs(text)
    prefix = _stack_prefix(state) if prefix is None else prefix

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
    normalizer = np.asarray(math.sqrt(hidden), dtype=embed_scale_dtype or dt).astype(dt)
    h = embed[ids] * normalizer

    # Rotary tables and masks per layer type.
    pos = np.arange(T)
    tables = {}
    for kind, rope_config in rope.items():
        angles = pos[:, None].astype(np.float64) * rope_inv_freq(rope_config, head_dim)[None]
        angles = np.concatenate([angles, angles], axis=-1)
        tables[kind] = (np.cos(angles).astype(dt), np.sin(angles).astype(dt))
    future = pos[None, :] > pos[:, None]  # [q, k]
    masks = {"full_attention": future, "sliding_attention": future}
    if window:
        masks["sliding_attention"] = future | (pos[None, :] <= pos[:, None] - window)

    for i, kind in enumerate(layer_types):
        p = f"{prefix}.layers.{i}"
        cos, sin = tables[kind]
        x = _gemma_norm(h, get(f"{p}.input_layernorm.weight"), eps)
        q = linear(x, f"{p}.self_attn.q_proj").reshape(T, n_heads, head_dim).transpose(1, 0, 2)
        k = linear(x, f"{p}.self_attn.k_proj").reshape(T, n_kv, head_dim).transpose(1, 0, 2)
        v = linear(x, f"{p}.self_attn.v_proj").reshape(T, n_kv, head_dim).transpose(1, 0, 2)
        q = _gemma_norm(q, get(f"{p}.self_attn.q_norm.weight"), eps)
        k = _gemma_norm(k, get(f"{p}.self_attn.k_norm.weight"), eps)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k = np.repeat(k, n_rep, axis=0)  # [n_heads, T, d]: head h reads kv head h // n_rep
        v = np.repeat(v, n_rep, axis=0)
        scores = _softcap((q @ k.transpose(0, 2, 1)) * scale, attn_cap)
        scores[:, masks[kind]] = -np.inf
        scores -= scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        attn = (probs @ v).transpose(1, 0, 2).reshape(T, n_heads * head_dim)
        attn = linear(attn, f"{p}.self_attn.o_proj")
        h = h + _gemma_norm(attn, get(f"{p}.post_attention_layernorm.weight"), eps)
        x = _gemma_norm(h, get(f"{p}.pre_feedforward_layernorm.weight"), eps)
        mlp = gelu_tanh(linear(x, f"{p}.mlp.gate_proj")) * linear(x, f"{p}.mlp.up_proj")
        mlp = linear(mlp, f"{p}.mlp.down_proj")
        h = h + _gemma_norm(mlp, get(f"{p}.post_feedforward_layernorm.weight"), eps)
    h = _gemma_norm(h, get(f"{prefix}.norm.weight"), eps)
    head_key = (
        "lm_head.weight" if prefix == "model" else f"{prefix.rsplit('.', 1)[0]}.lm_head.weight"
    )
    if head_key in state:
        head = get(head_key)
    elif "lm_head.weight" in state:
        head = get("lm_head.weight")
    else:
        head = embed  # Gemma ties its embeddings
    return _softcap(h @ head.T, final_cap)
