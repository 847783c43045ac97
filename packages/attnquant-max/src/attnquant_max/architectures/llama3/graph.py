"""The in-graph Llama's MAX modules: MAX's Llama3 with its projections swapped for theta layers.

:class:`ThetaLlama3` builds the stock :class:`~max.pipelines.architectures.llama3.llama3.Llama3`
(embedding, norms, attention kernels, KV cache, head all MAX's) and replaces, in every decoder
block, the three modules that hold projection weights:

* ``self_attn.qkv_proj`` (a ``StackedLinear`` the attention calls as ``qkv_proj(x)`` and splits
  after) by a :class:`~attnquant_max._layers.ThetaStackedLinear`;
* ``self_attn.o_proj`` by a :class:`~attnquant_max._layers.ThetaLinear`;
* ``mlp`` by a :class:`~attnquant_max._layers.ThetaMLP`.

Families banded with a ``W0`` stored in NVFP4 (format version 4) are NVFP4 layers with ``s``,
``U``, ``V`` in the same model, beside any float form, their packed bytes held once per band.
:class:`NVFP4Llama3` swaps every projection for an NVFP4 layer (``--quant nvfp4``). In either,
``--quant-head`` swaps the head for one too (the state then holds ``lm_head.weight_scale_2``),
and ``--quant-embedding`` the embedding for an NVFP4 lookup (:class:`NVFP4Embedding`: its own
``embed_tokens.*`` tensors, or a tied model's head bytes).
Importing this module imports ``max.pipelines`` (~15 s).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Literal

from max.dtype import DType
from max.pipelines.architectures.llama3.llama3 import Llama3
from max.pipelines.architectures.llama3.model_config import Llama3Config

from attnquant_core.serving import InGraphLayout, ServingOptions

from ..._layers import ThetaBuilder, ThetaMLP
from ..._nvfp4_embedding import NVFP4Embedding
from ..._nvfp4_layers import (
    NVFP4Linear,
    NVFP4MergedLinear,
    NVFP4StackedLinear,
    nvfp4_fused,
    nvfp4_tiled,
)

__all__ = [
    "GATE_UP",
    "MERGED",
    "MERGED_NAMES",
    "QKV",
    "EmbeddingTable",
    "NVFP4Llama3",
    "ThetaLlama3",
]

logger = logging.getLogger(__name__)

#: Where an NVFP4 embedding's table is (``--quant-embedding``): its own ``embed_tokens.*``
#: tensors, or a tied model's head (``lm_head.*``); ``None``: the stock float table.
EmbeddingTable = Literal["own", "head"] | None


QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")


GATE_UP = ("mlp.gate_proj", "mlp.up_proj")


def _shapes(config: Llama3Config) -> dict[str, tuple[int, int]]:
    hidden, head_dim = config.hidden_size, config.kv_params.head_dim
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    ffl = config.intermediate_size
    return {
        "self_attn.q_proj": (q, hidden),
        "self_attn.k_proj": (kv, hidden),
        "self_attn.v_proj": (kv, hidden),
        "self_attn.o_proj": (hidden, q),
        "mlp.gate_proj": (ffl, hidden),
        "mlp.up_proj": (ffl, hidden),
        "mlp.down_proj": (hidden, ffl),
    }


def _refuse_unsupported(config: Llama3Config, what: str) -> None:
    unsupported = {
        "attention_bias": config.attention_bias,
        "clip_qkv": config.clip_qkv,
        "quant_config": config.quant_config,
        "quantization_config": config.quantization_config,
        "model_quantization_encoding": config.model_quantization_encoding,
        "stacked_qkv": config.stacked_qkv,
        "stacked_mlp": config.stacked_mlp,
    }
    if any(unsupported.values()):
        named = ", ".join(k for k, v in unsupported.items() if v)
        raise NotImplementedError(f"{what} does not support {named} yet")


class ThetaLlama3(Llama3):
    """The stock single-device Llama3 with theta projections (see the module docstring).

    Over another architecture's blocks (Gemma 3's: :class:`~..gemma3.graph.ThetaGemma3`), the
    same swaps, the MLP with that architecture's ``mlp_activation``.

    Weight names: the stock ones for everything but the projections;
    ``layers.<i>.<family>.theta_{s,U,V}`` and the band weights of
    :mod:`attnquant_core.serving._layout` for those. A family banded with an NVFP4 ``W0`` (GEMM path)
    keeps the checkpoint's names, ``attnquant.shared.<family>.<band>.W0_packed``, ``W0_scale``,
    ``W0_scale_2`` held once per band, and runs as ``options.nvfp4_kernel`` says (fused
    ``generated_linear_nvfp4`` or dequantized in the graph; ``auto`` timed once at start-up).
    """

    mlp_activation = "silu"

    def __init__(
        self,
        config: Llama3Config,
        layout: InGraphLayout,
        *,
        head: bool = False,
        embedding: EmbeddingTable = None,
        options: ServingOptions | None = None,
    ) -> None:
        _refuse_unsupported(
            config,
            "the in-graph theta Llama (serve this model on the precompute-outside path: "
            "--path precompute-outside)",
        )
        super().__init__(config)
        shapes = _shapes(config)
        if layout.nvfp4:
            wrong = {f: s for f, s in layout.nvfp4_shapes.items() if s != shapes.get(f)}
            if wrong:
                raise ValueError(
                    f"the NVFP4 W0 of {', '.join(wrong)} is {list(wrong.values())}, the model's "
                    f"config asks for {[shapes.get(f) for f in wrong]}"
                )
        # NVFP4 bands, or the head alone in NVFP4 beside float forms: one choice for both.
        options = ServingOptions() if options is None else options
        fused = (layout.nvfp4 or head) and _nvfp4_kernel_fused(
            config.devices[0], shapes, options.nvfp4_kernel
        )
        self.needs_kernels = fused
        self.nvfp4_tiled = fused and options.nvfp4_tiled and nvfp4_tiled(config.devices[0])
        self.nvfp4_int8 = _nvfp4_int8(options, fused=fused, tiled=self.nvfp4_tiled)
        builder = ThetaBuilder(
            layout,
            num_layers=config.num_hidden_layers,
            shapes=shapes,
            dtype=config.dtype,
            device=config.devices[0],
            nvfp4_fused=fused,
            nvfp4_tiled=self.nvfp4_tiled,
            nvfp4_int8=self.nvfp4_int8,
        )
        for i, block in enumerate(self.layers):
            block.self_attn.replace_module("qkv_proj", builder.stacked(QKV, i))
            block.self_attn.replace_module("o_proj", builder.linear("self_attn.o_proj", i))
            block.replace_module("mlp", builder.mlp(i, activation=self.mlp_activation))
        self.attnquant_blocks = builder.bank
        self.layout = layout
        if head:
            _nvfp4_head(self, config, fused=fused, tiled=self.nvfp4_tiled, int8=self.nvfp4_int8)
        _nvfp4_embedding(self, config, embedding, tiled=self.nvfp4_tiled)


class NVFP4Llama3(Llama3):
    """The stock single-device Llama3 with NVFP4 projections: dequantized in the graph, or
    fused ``generated_linear_nvfp4`` dispatches, whichever was faster at start-up (logged).

    Dequantized, ``self_attn.qkv_proj`` and ``mlp.gate_proj``/``up_proj`` stay one matmul each
    over the concatenated dequantized weights, as in the stock model; weight names are the stock
    ones plus ``weight_scale`` and ``weight_scale_2`` per projection
    (:mod:`attnquant_max._nvfp4_layers`). Fused in float32 (the CPU), each of the two is one
    dispatch over the members' packed weights concatenated at load
    (:class:`~attnquant_max._nvfp4_layers.NVFP4MergedLinear`: ``self_attn.qkv_proj.*`` and
    ``mlp.gate_up_proj.*``, written by :func:`_merge_state`); fused in bfloat16, one each.
    """

    mlp_activation = "silu"

    def __init__(
        self,
        config: Llama3Config,
        *,
        head: bool = False,
        embedding: EmbeddingTable = None,
        options: ServingOptions | None = None,
    ) -> None:
        _refuse_unsupported(config, "NVFP4 serving (--quant nvfp4)")
        super().__init__(config)
        shapes = _shapes(config)
        dtype, device = config.dtype, config.devices[0]
        options = ServingOptions() if options is None else options
        fused = _nvfp4_kernel_fused(device, shapes, options.nvfp4_kernel)
        self.needs_kernels = fused
        self.nvfp4_tiled = tiled = fused and options.nvfp4_tiled and nvfp4_tiled(device)
        self.nvfp4_int8 = int8 = _nvfp4_int8(options, fused=fused, tiled=tiled)
        self.nvfp4_merged = merged = fused and options.nvfp4_merge and _nvfp4_merged(dtype)

        def linear(family: str) -> NVFP4Linear:
            out_dim, in_dim = shapes[family]
            return NVFP4Linear(
                in_dim, out_dim, dtype=dtype, device=device, fused=fused, tiled=tiled, int8=int8
            )

        def stacked(families: tuple[str, ...]) -> NVFP4MergedLinear | NVFP4StackedLinear:
            if merged:
                out_dims = [shapes[f][0] for f in families]
                in_dim = shapes[families[0]][1]
                return NVFP4MergedLinear(
                    in_dim,
                    out_dims,
                    dtype=dtype,
                    device=device,
                    fused=True,
                    tiled=tiled,
                    int8=int8,
                )
            names = [f.split(".")[-1] for f in families]
            return NVFP4StackedLinear([linear(f) for f in families], names)

        for block in self.layers:
            block.self_attn.replace_module("qkv_proj", stacked(QKV))
            block.self_attn.replace_module("o_proj", linear("self_attn.o_proj"))
            mlp = ThetaMLP(
                stacked(GATE_UP),  # type: ignore[arg-type]
                linear("mlp.down_proj"),  # type: ignore[arg-type]
                activation=self.mlp_activation,
            )
            block.replace_module("mlp", mlp)
        if head:
            _nvfp4_head(self, config, fused=fused, tiled=tiled, int8=int8)
        _nvfp4_embedding(self, config, embedding, tiled=tiled)


def _nvfp4_int8(options: ServingOptions, *, fused: bool, tiled: bool) -> bool:
    """``--nvfp4-int8`` (the default) where it can run: on the tiled layout (fused, a CPU with
    AVX-512); elsewhere the float op serves, as the option says. Logged once a load."""
    int8 = options.nvfp4_int8 and tiled
    if fused:
        why = (
            "int8 activations (--nvfp4-int8)"
            if int8
            else "float activations (--no-nvfp4-int8)"
            if not options.nvfp4_int8
            else "float activations (int8 runs on the tiled layout: a CPU with AVX-512)"
        )
        logger.info("NVFP4 projections: %s", why)
    return int8


def _nvfp4_merged(dtype: Any) -> bool:
    """Whether fused NVFP4 q/k/v and gate/up run as one dispatch each
    (:class:`~attnquant_max._nvfp4_layers.NVFP4MergedLinear`): in float32 activations."""
    return dtype == DType.float32


#: The merged NVFP4 projections of a layer (:class:`NVFP4Llama3`, fused, float32): MAX's name of
#: the merged module, and its members in order.
MERGED = {"self_attn.qkv_proj": QKV, "mlp.gate_up_proj": GATE_UP}


#: The tensors of a merged projection, in :func:`merge_nvfp4`'s order.
MERGED_NAMES = ("weight", "weight_scale", "weight_scale_2", "theta_s")


def _nvfp4_head(
    model: Llama3, config: Llama3Config, *, fused: bool, tiled: bool, int8: bool = False
) -> None:
    """Swap the stock head for an NVFP4 one (``--quant-head``): weights
    ``lm_head.weight``, ``weight_scale``, ``weight_scale_2``, run as the projections run. A tied
    head stops sharing the embedding's weight: the embedding keeps its float table."""
    model.replace_module(
        "lm_head",
        NVFP4Linear(
            config.hidden_size,
            config.vocab_size,
            dtype=config.dtype,
            device=config.devices[0],
            fused=fused,
            tiled=tiled,
            int8=int8,
        ),
    )


def _nvfp4_embedding(
    model: Llama3, config: Llama3Config, table: EmbeddingTable, *, tiled: bool
) -> None:
    """Swap the stock embedding for an NVFP4 lookup (``--quant-embedding``) over its own
    tensors or, ``table="head"``, the NVFP4 head's (a tied model: one 4-bit table), in the
    layout the model's fused projections hold (``tiled``)."""
    if table is None:
        return
    band = None
    if table == "head":
        head = model.lm_head
        if not isinstance(head, NVFP4Linear):
            raise ValueError("a tied NVFP4 embedding reads the NVFP4 head: --quant-head")
        band = (head.weight, head.weight_scale, head.weight_scale_2)
    model.replace_module(
        "embed_tokens",
        NVFP4Embedding(
            config.vocab_size,
            config.hidden_size,
            dtype=config.dtype,
            device=config.devices[0],
            band=band,
            tiled=tiled,
        ),
    )


def _nvfp4_kernel_fused(device: Any, shapes: Mapping[str, tuple[int, int]], kernel: str) -> bool:
    """generated_linear_nvfp4 or dequantize + matmul: ``--nvfp4-kernel``, or (auto) timed once
    per process on the model's gate_proj shape, and logged."""
    if kernel == "auto":
        return nvfp4_fused(device, *shapes["mlp.gate_proj"])
    logger.info("NVFP4 projections on %s: %s (--nvfp4-kernel)", device, kernel)
    return kernel == "fused"
