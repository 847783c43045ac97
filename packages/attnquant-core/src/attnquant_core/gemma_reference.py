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
dtype of the weights. As in :mod:`attnquant_core.llama_reference`, the forward is also offered
one piece at a time (:func:`gemma3_spec`, :func:`gemma3_rope_tables`, :func:`gemma3_embed`,
:func:`gemma3_layer` with a projection-input ``capture``, :func:`gemma3_head`) for a
layer-by-layer calibration pass over batches of windows. ``config`` may be a ``Gemma3ForCausalLM`` config or a
``Gemma3ForConditionalGeneration`` one (its ``text_config`` is used).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .llama_reference import (
    Capture,
    Getter,
    ReferenceConfigError,
    _attend,
    _linear,
    _rms_norm,
    rope_inv_freq,
)

__all__ = [
    "GemmaSpec",
    "gelu_tanh",
    "gemma3_embed",
    "gemma3_head",
    "gemma3_layer",
    "gemma3_layer_types",
    "gemma3_logits",
    "gemma3_rope_configs",
    "gemma3_rope_tables",
    "gemma3_spec",
    "gemma_norm",
]

_KINDS = ("sliding_attention", "full_attention")


def _field(config: Mapping, name: str) -> Any:
    if name not in config or config[name] is None:
        raise ReferenceConfigError(f"config has no {name!r}; the Gemma reference forward needs it")
    return config[name]


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """``gelu_pytorch_tanh``: ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``."""
    c = x.dtype.type(math.sqrt(2.0 / math.pi))
    return 0.5 * x * (1.0 + np.tanh(c * (x + x.dtype.type(0.044715) * x**3)))


def gemma_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Gemma's RMSNorm: ``x / sqrt(mean(x^2) + eps) * (1 + w)``."""
    return _rms_norm(x, 1.0 + weight, eps)


def gemma3_layer_types(config: Mapping) -> list[str]:
    """``"sliding_attention"`` or ``"full_attention"`` per layer, from ``layer_types`` or,
    for configs without it, ``sliding_window_pattern`` (every ``pattern``-th layer global)."""
    config = config.get("text_config", config)
    n = int(_field(config, "num_hidden_layers"))
    types = config.get("layer_types")
    if types is not None:
        if len(types) != n:
            raise ReferenceConfigError(f"layer_types has {len(types)} entries for {n} layers")
        bad = sorted(set(types) - set(_KINDS))
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
        for kind in _KINDS:
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


@dataclass(frozen=True, kw_only=True)
class GemmaSpec:
    """What a Gemma 3 decoder layer needs, read and checked from ``config.json``."""

    hidden: int
    n_heads: int
    n_kv: int
    head_dim: int
    eps: float
    #: ``query_pre_attn_scalar ** -0.5``
    scale: float
    attn_softcap: float | None
    final_softcap: float | None
    #: ``sliding_window`` (0: sliding layers see every earlier key)
    window: int
    layer_types: tuple[str, ...]

    @property
    def n_rep(self) -> int:
        return self.n_heads // self.n_kv


def gemma3_spec(config: Mapping) -> GemmaSpec:
    """Check ``config`` (or its ``text_config``) is one the reference implements."""
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
    if n_heads % n_kv:
        raise ReferenceConfigError(f"num_attention_heads={n_heads} is not a multiple of kv={n_kv}")
    if head_dim % 2:
        raise ReferenceConfigError(f"head_dim={head_dim} is odd; rotary embeddings need pairs")
    return GemmaSpec(
        hidden=hidden,
        n_heads=n_heads,
        n_kv=n_kv,
        head_dim=head_dim,
        eps=float(text.get("rms_norm_eps", 1e-6)),
        scale=float(text.get("query_pre_attn_scalar") or head_dim) ** -0.5,
        attn_softcap=text.get("attn_logit_softcapping") or None,
        final_softcap=text.get("final_logit_softcapping") or None,
        window=int(text.get("sliding_window") or 0),
        layer_types=tuple(gemma3_layer_types(text)),
    )


def gemma3_rope_tables(
    config: Mapping, spec: GemmaSpec, length: int, dtype: np.dtype | type = np.float64
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{layer type: (cos, sin)}``, each ``[length, head_dim]`` (rotate_half layout)."""
    tables = {}
    for kind, rope_config in gemma3_rope_configs(config).items():
        freq = rope_inv_freq(rope_config, spec.head_dim)
        angles = np.arange(length, dtype=np.float64)[:, None] * freq[None]
        angles = np.concatenate([angles, angles], axis=-1)
        tables[kind] = (np.cos(angles).astype(dtype), np.sin(angles).astype(dtype))
    return tables


def gemma3_embed(
    spec: GemmaSpec,
    rows: np.ndarray,
    *,
    dtype: np.dtype | type = np.float64,
    embed_scale_dtype: np.dtype | type | None = None,
) -> np.ndarray:
    """Embedding ``rows`` (``embed_tokens.weight[ids]``) times ``sqrt(hidden)``, the scale
    rounded to ``embed_scale_dtype`` (default: ``dtype``) as Hugging Face rounds it to the
    weight's dtype."""
    dt = np.dtype(dtype)
    normalizer = np.asarray(math.sqrt(spec.hidden), dtype=embed_scale_dtype or dt).astype(dt)
    return np.asarray(rows, dtype=dt) * normalizer


def _softcap(x: np.ndarray, cap: float | None) -> np.ndarray:
    if not cap:
        return x
    cap = x.dtype.type(cap)
    return cap * np.tanh(x / cap)


def _mask(kind: str, T: int, window: int, dtype: np.dtype) -> np.ndarray:
    """Additive ``[T, T]`` mask: ``-inf`` where query ``q`` may not read key ``k``."""
    q, k = np.arange(T)[:, None], np.arange(T)[None, :]
    hidden = k > q
    if kind == "sliding_attention" and window:
        hidden |= k <= q - window
    return np.where(hidden, -np.inf, 0.0).astype(dtype)


def gemma3_layer(
    spec: GemmaSpec,
    get: Getter,
    layer_prefix: str,
    h: np.ndarray,
    tables: Mapping[str, tuple[np.ndarray, np.ndarray]],
    *,
    layer: int,
    has_key: Callable[[str], bool] = lambda key: False,
    capture: Capture | None = None,
) -> np.ndarray:
    """Decoder layer ``layer`` on hidden states ``h [..., T, hidden]`` (equal-length sequences,
    positions ``0..T-1``); returns the new hidden states.

    ``get`` returns a tensor in the compute dtype; ``has_key`` says whether a projection bias
    is stored; ``capture``, when given, sees the input of each projection.
    """
    kind = spec.layer_types[layer]
    cos, sin = tables[kind]
    p = layer_prefix
    T = h.shape[-2]
    lead = h.shape[:-2]
    cos, sin = cos[:T], sin[:T]
    linear = _linear(get, has_key)

    def heads(x: np.ndarray, n: int) -> np.ndarray:  # [..., T, n*d] -> [..., n, T, d]
        return np.swapaxes(x.reshape(*lead, T, n, spec.head_dim), -3, -2)

    x = gemma_norm(h, get(f"{p}.input_layernorm.weight"), spec.eps)
    if capture is not None:
        capture(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), x)
    q = heads(linear(x, f"{p}.self_attn.q_proj"), spec.n_heads)
    k = heads(linear(x, f"{p}.self_attn.k_proj"), spec.n_kv)
    v = heads(linear(x, f"{p}.self_attn.v_proj"), spec.n_kv)
    q = gemma_norm(q, get(f"{p}.self_attn.q_norm.weight"), spec.eps)
    k = gemma_norm(k, get(f"{p}.self_attn.k_norm.weight"), spec.eps)
    attn = _attend(
        q,
        k,
        v,
        cos,
        sin,
        n_rep=spec.n_rep,
        scale=spec.scale,
        mask=_mask(kind, T, spec.window, h.dtype),
        softcap=lambda scores: _softcap(scores, spec.attn_softcap),
    )
    del q, k, v
    if capture is not None:
        capture(("self_attn.o_proj",), attn)
    attn = linear(attn, f"{p}.self_attn.o_proj")
    h = h + gemma_norm(attn, get(f"{p}.post_attention_layernorm.weight"), spec.eps)
    x = gemma_norm(h, get(f"{p}.pre_feedforward_layernorm.weight"), spec.eps)
    if capture is not None:
        capture(("mlp.gate_proj", "mlp.up_proj"), x)
    inner = gelu_tanh(linear(x, f"{p}.mlp.gate_proj")) * linear(x, f"{p}.mlp.up_proj")
    if capture is not None:
        capture(("mlp.down_proj",), inner)
    mlp = linear(inner, f"{p}.mlp.down_proj")
    return h + gemma_norm(mlp, get(f"{p}.post_feedforward_layernorm.weight"), spec.eps)


def _stack_prefix(has_key: Callable[[str], bool]) -> str:
    for prefix in ("model", "language_model.model", "model.language_model"):
        if has_key(f"{prefix}.embed_tokens.weight"):
            return prefix
    raise ReferenceConfigError(
        "state has no '<prefix>.embed_tokens.weight' under model., language_model.model. or "
        "model.language_model.; pass prefix="
    )


def gemma3_head(
    get: Getter, has_key: Callable[[str], bool], prefix: str = "model"
) -> tuple[np.ndarray, np.ndarray]:
    """``(final norm weight, output head [vocab, hidden])``: an ``lm_head`` when one is stored
    (``lm_head.weight`` or ``language_model.lm_head.weight``), else the tied embedding.
    Apply the norm with :func:`gemma_norm` and the head's ``final_softcap``."""
    outer = prefix.rsplit(".", 1)[0] if prefix != "model" else ""
    for key in (f"{outer}.lm_head.weight" if outer else "", "lm_head.weight"):
        if key and has_key(key):
            return get(f"{prefix}.norm.weight"), get(key)
    return get(f"{prefix}.norm.weight"), get(f"{prefix}.embed_tokens.weight")


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
    spec = gemma3_spec(config)
    has_key = state.__contains__
    prefix = _stack_prefix(has_key) if prefix is None else prefix

    def get(key: str) -> np.ndarray:
        if key not in state:
            raise ReferenceConfigError(f"state has no {key!r}")
        return np.asarray(state[key], dtype=dt)

    ids = np.asarray(ids, dtype=np.int64)
    if ids.ndim != 1 or not len(ids):
        raise ReferenceConfigError("ids must be a non-empty 1-D sequence of token ids")
    embed = get(f"{prefix}.embed_tokens.weight")
    if ids.min() < 0 or ids.max() >= embed.shape[0]:
        raise ReferenceConfigError(f"token ids outside 0..{embed.shape[0] - 1}")
    h = gemma3_embed(spec, embed[ids], dtype=dt, embed_scale_dtype=embed_scale_dtype)
    tables = gemma3_rope_tables(config, spec, len(ids), dt)
    for i in range(len(spec.layer_types)):
        h = gemma3_layer(spec, get, f"{prefix}.layers.{i}", h, tables, layer=i, has_key=has_key)
    norm, head = gemma3_head(get, has_key, prefix)
    return _softcap(gemma_norm(h, norm, spec.eps) @ head.T, spec.final_softcap)
