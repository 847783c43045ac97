"""The ``config.json`` dicts of the tiny Gemma checkpoints of :mod:`attnquant_core.tiny_gemma`:
what ``transformers`` (5.x, :data:`TRANSFORMERS_VERSION`) writes for the same sizes, plus
``architectures`` and ``dtype`` as ``save_pretrained`` adds them. Import them from
:mod:`attnquant_core.tiny_gemma`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .io._gemma3_config import _layer_types, gemma3_text_config

__all__ = [
    "TRANSFORMERS_VERSION",
    "gemma3_conditional_config",
    "gemma3_text_config",
    "gemma4_config",
]

#: The ``transformers`` release whose ``config.json`` these dicts reproduce.
TRANSFORMERS_VERSION = "5.12.1"


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
