"""Gemma 3 text as MAX modules on one device, float32 on a CPU: MAX's Llama3 model with Gemma's
blocks, norms, embedding scale and rotary tables.

MAX 26.7's own Gemma 3 is tied to GPUs by its wrapper (Allreduce, bfloat16 norms, signal
buffers; docs/gemma3-cpu.md), not by its layers. :class:`Gemma3Text` keeps what MAX's
:class:`~max.pipelines.architectures.llama3.llama3.Llama3` does the same (the embedding, the tied
head, the one paged KV cache, the last-token or echo logits) and builds in each layer what
Gemma 3 does differently:

* MAX's :class:`Gemma3Attention`: q and k RMSNorms per head before the rotary embedding, the
  ``query_pre_attn_scalar ** -0.5`` scale, and on the sliding layers the fused CPU attention's
  sliding-window causal mask (key ``k`` seen from query ``q`` when ``q - window < k <= q``);
  global layers causal. Rotary tables per layer type (``rope_local_base_freq`` on the sliding
  layers, ``rope_theta`` with its linear scaling on the global ones);
* four ``(1 + w)`` RMSNorms a block (before and after the attention and the MLP), in the
  activation dtype (MAX's own are bfloat16);
* a GeGLU MLP (the tanh GELU), the embedding times ``sqrt(hidden)``.

:class:`ThetaGemma3` and :class:`NVFP4Gemma3` are the Llama architecture's theta and NVFP4
models over these blocks (the projections the same modules, names and shapes as Llama's).
Importing this module imports ``max.pipelines`` (~15 s).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from max.dtype import DType
from max.graph import TensorValue
from max.nn.kv_cache import PagedCacheValues
from max.nn.layer import LayerList, Module
from max.nn.linear import MLP
from max.nn.rotary_embedding import Llama3RopeScalingParams, Llama3RotaryEmbedding
from max.pipelines.architectures.gemma3.layers.attention import Gemma3Attention
from max.pipelines.architectures.gemma3.layers.rms_norm import Gemma3RMSNorm
from max.pipelines.architectures.llama3.llama3 import Llama3
from max.pipelines.architectures.llama3.model_config import Llama3Config

from ..llama3.graph import NVFP4Llama3, ThetaLlama3

__all__ = [
    "Gemma3Block",
    "Gemma3Text",
    "Gemma3TextConfig",
    "NVFP4Gemma3",
    "ThetaGemma3",
    "gemma3_fields",
]

SLIDING, GLOBAL = "sliding_attention", "full_attention"


@dataclasses.dataclass
class Gemma3TextConfig(Llama3Config):
    """:class:`Llama3Config` and what a Gemma 3 text decoder adds (:func:`gemma3_fields`)."""

    layer_types: tuple[str, ...] = ()
    #: ``rope_local_base_freq``: the sliding layers' rotary base (never scaled)
    rope_local_theta: float = 10_000.0
    #: the global layers' linear rotary scaling factor (None: no scaling)
    rope_global_factor: float | None = None
    #: ``query_pre_attn_scalar ** -0.5``
    query_scale: float = 0.0
    #: ``max_position_embeddings``: the rotary tables' length
    max_position_embeddings: int = 0

    @classmethod
    def initialize_from_config(  # type: ignore[override]
        cls,
        pipeline_config: Any,
        huggingface_config: Any,
        model_config: Any = None,
        *,
        max_seq_len: int,
    ) -> Gemma3TextConfig:
        """Llama's reading of the config (sizes, dtype, KV cache), given the global layers'
        rotary base flat (transformers 5 nests it per layer type), then Gemma's fields."""
        hf = huggingface_config
        fields = gemma3_fields(hf.to_dict() if hasattr(hf, "to_dict") else dict(hf))
        flat = _FlatRope(hf, fields["rope_theta"])
        base = super().initialize_from_config(
            pipeline_config, flat, model_config, max_seq_len=max_seq_len
        )
        return dataclasses.replace(base, **fields)


class _FlatRope:
    """A Hugging Face config read through, its rotary fields as Llama's reader takes them: one
    base, no scaling (Gemma's two tables are built by :class:`Gemma3Text`)."""

    def __init__(self, config: Any, rope_theta: float) -> None:
        self._config = config
        self.rope_theta = rope_theta
        self.rope_scaling = None
        self.rope_parameters = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)

    def __contains__(self, name: str) -> bool:
        return name in self._config


def gemma3_fields(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """The Gemma fields of :class:`Gemma3TextConfig` from a ``config.json`` dict (transformers
    4 or 5 layout), checked: what this architecture does not implement raises ValueError."""
    from attnquant_core.gemma_reference import gemma3_rope_configs, gemma3_spec

    spec = gemma3_spec(hf_config)
    if spec.attn_softcap or spec.final_softcap:
        raise ValueError(
            "Gemma 3 with attn_logit_softcapping or final_logit_softcapping (Gemma 2's) is not "
            "served on this architecture"
        )
    if any(kind not in (SLIDING, GLOBAL) for kind in spec.layer_types):
        raise ValueError(f"layer_types {sorted(set(spec.layer_types))}: not Gemma 3's")
    if SLIDING in spec.layer_types and spec.window <= 0:
        raise ValueError("sliding layers with no sliding_window")
    ropes = gemma3_rope_configs(hf_config)
    factor = None
    scaling = ropes[GLOBAL]["rope_scaling"] or {}
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "linear":
        factor = float(scaling["factor"])
    elif kind != "default":
        raise ValueError(f"Gemma 3 global rotary scaling {kind!r}: linear or none is served")
    local = ropes[SLIDING]["rope_scaling"] or {}
    if (local.get("rope_type") or local.get("type") or "default") != "default":
        raise ValueError("Gemma 3 sliding layers with a scaled rotary embedding")
    text = hf_config.get("text_config", hf_config)
    return {
        "layer_types": spec.layer_types,
        "sliding_window": spec.window,
        "rope_theta": ropes[GLOBAL]["rope_theta"],
        "rope_local_theta": ropes[SLIDING]["rope_theta"],
        "rope_global_factor": factor,
        "query_scale": spec.scale,
        "rms_norm_eps": spec.eps,
        "max_position_embeddings": int(text.get("max_position_embeddings") or 0),
    }


class Gemma3Block(Module):
    """One Gemma 3 decoder layer, called as MAX's ``TransformerBlock`` is (the ``freqs_cis`` it
    is handed is unused: the attention holds its layer type's rotary table)."""

    def __init__(
        self, attention: Gemma3Attention, mlp: Module, hidden: int, eps: float, dtype: DType
    ) -> None:
        super().__init__()
        self.self_attn = attention
        self.mlp = mlp
        self.input_layernorm = Gemma3RMSNorm(hidden, dtype, eps)
        self.post_attention_layernorm = Gemma3RMSNorm(hidden, dtype, eps)
        self.pre_feedforward_layernorm = Gemma3RMSNorm(hidden, dtype, eps)
        self.post_feedforward_layernorm = Gemma3RMSNorm(hidden, dtype, eps)

    def __call__(
        self,
        layer_idx: TensorValue,
        x: TensorValue,
        kv_collection: PagedCacheValues,
        freqs_cis: TensorValue,
        input_row_offsets: TensorValue,
    ) -> TensorValue:
        attn = self.self_attn(
            self.input_layernorm(x), kv_collection, input_row_offsets=input_row_offsets
        )
        h = x + self.post_attention_layernorm(attn)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


def _rope(config: Gemma3TextConfig, theta: float, factor: float | None) -> Llama3RotaryEmbedding:
    scaling = None
    if factor is not None:  # linear scaling, as MAX's Gemma 3 writes it
        scaling = Llama3RopeScalingParams(
            factor=factor,
            low_freq_factor=1e38,
            high_freq_factor=1e38,
            orig_max_position=config.max_position_embeddings,
        )
    return Llama3RotaryEmbedding(
        dim=config.hidden_size,
        n_heads=config.num_attention_heads,
        theta=theta,
        max_seq_len=config.max_position_embeddings or config.max_seq_len,
        head_dim=config.kv_params.head_dim,
        interleaved=False,
        scaling_params=scaling,
    )


class Gemma3Text(Llama3):
    """Gemma 3 text on one device, float32 on a CPU (see the module docstring).

    Weight names are MAX's Llama ones (``layers.<i>.self_attn.q_proj.weight`` ...) plus Gemma's
    ``self_attn.{q,k}_norm``, ``pre_feedforward_layernorm`` and ``post_feedforward_layernorm``:
    a Hugging Face checkpoint's names with ``model.`` taken off.
    """

    #: The gated MLP's activation, read by the theta and NVFP4 models' MLPs.
    mlp_activation = "gelu_tanh"

    def __init__(self, config: Gemma3TextConfig) -> None:
        if not isinstance(config, Gemma3TextConfig) or len(config.layer_types) != (
            config.num_hidden_layers
        ):
            raise ValueError("Gemma3Text needs a Gemma3TextConfig with one layer type a layer")
        super().__init__(config)
        device, dtype = config.devices[0], config.dtype
        rope_global = _rope(config, config.rope_theta, config.rope_global_factor)
        rope_local = _rope(config, config.rope_local_theta, None)
        head_dim, eps = config.kv_params.head_dim, float(config.rms_norm_eps or 1e-6)
        layers = []
        for i, kind in enumerate(config.layer_types):
            attention = Gemma3Attention(
                rope_global=rope_global,
                rope_local=rope_local,
                num_attention_heads=config.num_attention_heads,
                num_key_value_heads=config.num_key_value_heads,
                hidden_size=config.hidden_size,
                kv_params=config.kv_params,
                layer_idx=i,
                is_sliding=kind == SLIDING,
                dtype=dtype,
                devices=[device],
                scale=config.query_scale,
                qk_norm_eps=eps,
                local_window_size=config.sliding_window or 1,
            )
            # MAX's q/k norms are bfloat16 weights; these run in the activation dtype.
            attention.q_norm = Gemma3RMSNorm(head_dim, dtype, eps)
            attention.k_norm = Gemma3RMSNorm(head_dim, dtype, eps)
            mlp = MLP(
                dtype,
                None,
                config.hidden_size,
                config.intermediate_size,
                [device],
                activation_function=self.mlp_activation,
            )
            layers.append(Gemma3Block(attention, mlp, config.hidden_size, eps, dtype))
        self.layers = LayerList(layers)
        self.norm = Gemma3RMSNorm(config.hidden_size, dtype, eps)
        self.rope = rope_global  # handed to every block, unused there
        self.embedding_multiplier = config.hidden_size**0.5


class ThetaGemma3(ThetaLlama3, Gemma3Text):
    """:class:`~..llama3.graph.ThetaLlama3`'s theta projections in Gemma 3's blocks."""

    mlp_activation = Gemma3Text.mlp_activation


class NVFP4Gemma3(NVFP4Llama3, Gemma3Text):
    """:class:`~..llama3.graph.NVFP4Llama3`'s NVFP4 projections in Gemma 3's blocks."""

    mlp_activation = Gemma3Text.mlp_activation
