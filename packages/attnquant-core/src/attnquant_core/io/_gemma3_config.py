"""The ``config.json`` of a Gemma 3 text model, as ``transformers`` (5.x) writes it: what
``attnquant import`` writes for a Gemma 3 GGUF, and what :mod:`attnquant_core.tiny_gemma`'s
tiny checkpoints carry (their sizes are this function's defaults)."""

from __future__ import annotations

from typing import Any

__all__ = ["gemma3_text_config"]


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
