"""The in-graph Llama's pipeline model: the stock Llama3 pipeline model, building the theta graph.

:class:`ThetaLlama3Model` builds :class:`~.graph.ThetaLlama3` (or :class:`~.graph.NVFP4Llama3`)
instead of the stock model when its weight adapter handed it theta tensors under a plan that
asks for an in-graph path; otherwise its graph is the stock one. Where the fused NVFP4 op
serves, the state is rewritten at load (q/k/v and gate/up merged, :func:`_merge_state`; the
tiled layout on an AVX-512 CPU, :func:`_tile_state`). Nothing in MAX is patched.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections import Counter
from collections.abc import Mapping
from typing import Any

from max.graph import Graph
from max.pipelines.architectures.llama3.llama3 import Llama3
from max.pipelines.architectures.llama3.model import Llama3Model
from max.pipelines.architectures.llama3.model_config import Llama3Config
from max.pipelines.lib.graph_specs import GraphRole, GraphSpec

from attnquant_core import FAMILIES
from attnquant_core.serving import InGraphLayout, ServingOptions
from attnquant_kernels import kernels_path
from attnquant_kernels.layout import tile_nvfp4

from ..._nvfp4_layers import merge_nvfp4
from ..._plan import ServingPlan
from ..._workers import lower_worker_priority
from .graph import MERGED, MERGED_NAMES, EmbeddingTable, NVFP4Llama3, ThetaLlama3

__all__ = ["ThetaLlama3Model", "count_matmuls", "decoder_graph"]

logger = logging.getLogger(__name__)

_MERGED_MEMBER = re.compile(
    r"^layers\.(\d+)\.("
    + "|".join(re.escape(f) for g in MERGED.values() for f in g)
    + r")\.weight$"
)


def _merge_state(state: dict[str, Any]) -> int:
    """Replace, in place, each layer's q/k/v and gate/up NVFP4 tensors of ``state``
    (``.weight``, ``.weight_scale``, ``.weight_scale_2``) by the tensors of one merged
    projection each (:func:`~attnquant_max._nvfp4_layers.merge_nvfp4`: the same packed bytes
    and scales, a float32 row scale for the per-tensor scales); the number of merged
    projections written. Row-major bytes: runs before :func:`_tile_state`."""
    import numpy as np
    from max.graph.weights import WeightData

    layers = sorted({int(m.group(1)) for k in state if (m := _MERGED_MEMBER.match(k))})
    count = 0
    for i in layers:
        for target, families in MERGED.items():
            prefixes = [f"layers.{i}.{f}" for f in families]
            keys = [[f"{p}.weight{t}" for t in ("", "_scale", "_scale_2")] for p in prefixes]
            missing = [k for group in keys for k in group if k not in state]
            if missing:
                raise ValueError(f"NVFP4 state of layer {i}: no {', '.join(missing)}")
            members = [tuple(np.from_dlpack(state.pop(k)) for k in group) for group in keys]
            merged = merge_nvfp4(members)  # type: ignore[arg-type]
            names = [f"layers.{i}.{target}.{t}" for t in MERGED_NAMES]
            for name, array in zip(names, merged, strict=True):
                state[name] = WeightData.from_numpy(np.ascontiguousarray(array), name)
            count += 1
    return count


def _tile_state(state: dict[str, Any]) -> int:
    """Rewrite every NVFP4 weight of ``state`` (packed codes and block scales: ``.weight`` and
    ``.weight_scale``, ``W0_packed`` and ``W0_scale``) in the tiled layout, in place; the
    number rewritten. Same shapes and bytes (:func:`attnquant_kernels.layout.tile_nvfp4`)."""
    import numpy as np
    from max.graph.weights import WeightData

    pairs = [(k[: -len("_scale")], k) for k in state if k.endswith(".weight_scale")]
    pairs += [(k[: -len("W0_scale")] + "W0_packed", k) for k in state if k.endswith(".W0_scale")]
    for packed_key, scale_key in pairs:
        packed, scale = tile_nvfp4(
            np.from_dlpack(state[packed_key]), np.from_dlpack(state[scale_key])
        )
        for key, array in ((packed_key, packed), (scale_key, scale)):
            state[key] = WeightData.from_numpy(array, getattr(state[key], "name", key))
    return len(pairs)


#: The per-tensor scale of an NVFP4 head (``--quant-head``), in MAX names.
HEAD_SCALE_2 = "lm_head.weight_scale_2"
#: The per-tensor scale of an NVFP4 embedding table of its own (``--quant-embedding``, untied).
EMBEDDING_SCALE_2 = "embed_tokens.weight_scale_2"


def _is_nvfp4_state(state_dict: Mapping[str, Any]) -> bool:
    """Whether the projections are NVFP4 (``--quant nvfp4``); the head and embedding not asked."""
    return any(
        key.endswith(".weight_scale_2") and key not in (HEAD_SCALE_2, EMBEDDING_SCALE_2)
        for key in state_dict
    )


def _embedding_table(state_dict: Mapping[str, Any], plan: ServingPlan) -> EmbeddingTable:
    """Where the NVFP4 embedding's table is (``--quant-embedding``): its own tensors when the
    state holds them, else (a tied model) the head's; ``None`` for the stock float table."""
    if not plan.embedding_nvfp4:
        return None
    return "own" if EMBEDDING_SCALE_2 in state_dict else "head"


def _layout_of(state_dict: Mapping[str, Any], plan: ServingPlan) -> InGraphLayout | None:
    """The in-graph layout of ``state_dict`` (``None``: dense); the plan picks the custom op.

    The custom op reads the same tensors as in-graph precompute, so the plan's path tells them
    apart, not the state. A state with no banded family reads back as a GEMM layout (its
    factors are the same on both paths); the plan serves it on the custom op only when
    ``--path custom-op`` asks for it.
    """
    options = plan.options
    shapes = {k: [int(d) for d in v.shape] for k, v in state_dict.items()}
    layout = InGraphLayout.from_state(shapes, FAMILIES, fuse=options.qkv_fuse)
    if layout is None or plan.path != "custom-op":
        return layout
    factored_only = not layout.groups and not layout.nvfp4 and not layout.stacked
    if not layout.gemm or (options.path == "custom-op" and factored_only):
        layout = dataclasses.replace(layout, custom_op=True, fused_mlp=options.fused_mlp)
    return layout


def _plan_of(state_dict: Mapping[str, Any]) -> ServingPlan | None:
    """The plan the weight adapter made this state under (an
    :class:`attnquant_max._adapter.PlannedState`); ``None`` for a state a stock adapter made
    (a GGUF checkpoint, served as MAX serves it)."""
    return getattr(state_dict, "plan", None)


class ThetaLlama3Model(Llama3Model):
    """The stock Llama3 pipeline model, building :class:`ThetaLlama3` on the in-graph paths.

    The weight adapter decides the path (:func:`attnquant_max.plan_serving`)
    and hands over either a dense state (precompute-outside: the stock graph,
    unchanged) or a theta state, from which the layout is read back.
    ``weight_bytes`` is the size of the weights the compiled decoder holds.
    """

    weight_bytes: int = 0
    _prepared_state: Any = None  # the state dict already merged and tiled for the fused op
    #: The graphs' models: theta projections, NVFP4 projections (dense: :meth:`_dense_specs`).
    theta_model: type[ThetaLlama3] = ThetaLlama3
    nvfp4_model: type[NVFP4Llama3] = NVFP4Llama3
    #: The decoder graph's name.
    graph_name = "llama3"

    def _create_model_config(self, state_dict: dict[str, Any]) -> Llama3Config:
        """MAX's Llama model config, made by this pipeline model's ``config_class`` (MAX's
        ``Llama3Model`` names ``Llama3Config`` itself; Gemma 3 text's is a subclass)."""
        model_config = self.config_class.initialize(
            self.pipeline_config, max_seq_len=self.max_seq_len
        )
        model_config.finalize(
            huggingface_config=self.huggingface_config,
            state_dict=state_dict,
            norm_method=self.norm_method,
            attention_bias=self.attention_bias,
            return_logits=self.return_logits,
            return_hidden_states=self.return_hidden_states,
        )
        return model_config

    def _dense_specs(self, model_config: Any) -> dict[str, GraphSpec]:
        """The dense model's graphs: MAX's stock Llama3 (one device or several)."""
        return dict(super().graph_specs(model_config))

    def graph_specs(self, model_config: Any) -> dict[str, GraphSpec]:
        plan = _plan_of(self.state_dict)
        if plan is None:  # a stock adapter's state (GGUF): the stock model
            return self._dense_specs(model_config)
        self._place_workers(plan.options.worker_nice)
        head = HEAD_SCALE_2 in self.state_dict  # --quant-head
        embedding = _embedding_table(self.state_dict, plan)  # --quant-embedding
        if _is_nvfp4_state(self.state_dict):
            self._single_device("NVFP4 serving (--quant nvfp4) runs on one device", model_config)
            model = self.nvfp4_model(
                model_config, head=head, embedding=embedding, options=plan.options
            )
            specs = {GraphRole.DECODER: self._spec(model_config, model)}
        elif (layout := _layout_of(self.state_dict, plan)) is None:
            if head:
                raise ValueError("an NVFP4 head is served beside NVFP4 projections only")
            specs = self._dense_specs(model_config)
        else:
            self._single_device(
                "the in-graph theta paths run on one device; serve on several with "
                "--path precompute-outside" + (" and no --quant" if layout.nvfp4 else ""),
                model_config,
            )
            model = self.theta_model(
                model_config, layout, head=head, embedding=embedding, options=plan.options
            )
            specs = {GraphRole.DECODER: self._spec(model_config, model)}
        self.weight_bytes = _nbytes(specs[GraphRole.DECODER].weights_registry())
        logger.info(
            "attnquant: the decoder holds %.2f MiB of weights (%d bytes)",
            self.weight_bytes / 2**20,
            self.weight_bytes,
        )
        return specs

    def _prepare_state(self, model_config: Llama3Config, model: Llama3) -> None:
        """Rewrite the state for the fused NVFP4 op, in place, as ``model`` reads it: q/k/v and
        gate/up merged (:func:`_merge_state`), then every packed weight tiled (:func:`_tile_state`)."""
        device = model_config.devices[0]
        if getattr(model, "nvfp4_merged", False):
            count = _merge_state(self.state_dict)
            logger.info(
                "NVFP4 on %s: q/k/v and gate/up of %d layers merged at load into one fused "
                "dispatch each (same packed bytes; per-tensor scales as a float32 row scale)",
                device,
                count // len(MERGED),
            )
        if getattr(model, "nvfp4_tiled", False):
            count = _tile_state(self.state_dict)
            logger.info(
                "NVFP4 on %s: %d packed weights rewritten at load in the tiled layout that "
                "generated_linear_nvfp4_tiled reads (same bytes; each tile of 16 rows one "
                "stream)",
                device,
                count,
            )

    def _place_workers(self, nice: int) -> None:
        """On a CPU: MAX's runtime workers at ``nice`` (``--worker-nice``), so the Python that
        drives each step is not kept waiting by workers spinning after a graph
        (:mod:`attnquant_max._workers`)."""
        if nice <= 0 or not all(device.is_host for device in self.devices):
            return
        count = lower_worker_priority(nice)
        logger.info(
            "attnquant: %d CPU runtime workers at nice %d (--worker-nice; 0 leaves them as "
            "MAX starts them)",
            count,
            nice,
        )

    def _single_device(self, message: str, model_config: Any) -> None:
        if model_config.data_parallel_degree > 1 or len(self.devices) > 1:
            raise NotImplementedError(message)

    def _spec(self, model_config: Llama3Config, model: Llama3) -> GraphSpec:
        if self._prepared_state is not self.state_dict:
            self._prepare_state(model_config, model)
            self._prepared_state = self.state_dict  # once per state, however often specs are built
        model.load_state_dict(
            self.state_dict, override_quantization_encoding=True, weight_alignment=1, strict=True
        )
        layout = getattr(model, "layout", None)
        custom_op = layout is not None and layout.custom_op
        kernels = [kernels_path()] if custom_op or getattr(model, "needs_kernels", False) else []
        return GraphSpec(
            model,
            self.graph_name,
            self._bind_graph_inputs(model.input_tree(self.kv_params)),
            weights=model.state_dict(),
            custom_extensions=kernels,
        )


def _nbytes(weights: Mapping[str, Any]) -> int:
    """Bytes of a weights registry (``max.driver.Buffer`` or numpy values)."""
    total = 0
    for value in weights.values():
        if hasattr(value, "num_elements"):  # a Buffer
            total += int(value.num_elements) * int(value.dtype.size_in_bytes)
        else:
            total += int(value.nbytes)
    return total


def decoder_graph(loaded: Any, options: ServingOptions) -> tuple[Graph, int]:
    """Trace, without compiling, the decoder ``loaded``'s checkpoint would get under ``options``.

    Runs the architecture's weight adapter on the checkpoint again with ``options``, builds the
    model the pipeline model would build, and traces it. For measurements: the matmuls in the
    IR (:func:`count_matmuls`) and the weight bytes.

    Parameters
    ----------
    loaded : LoadedModel
        A model loaded by :func:`attnquant_max.load_pipeline` (any path): its
        pipeline config, weights and KV-cache parameters are reused.

    Returns
    -------
    graph : max.graph.Graph
    weight_bytes : int
        Bytes of the weights the graph binds.
    """
    pm = loaded.model.pipeline._pipeline_model
    if not isinstance(pm, ThetaLlama3Model):
        raise TypeError(f"decoder_graph needs an attnquant Llama model, got {type(pm).__name__}")
    adapter = dataclasses.replace(pm.adapter, options=options)
    state = adapter(
        dict(pm.weights.items()),
        huggingface_config=pm.huggingface_config,
        pipeline_config=pm.pipeline_config,
    )
    probe = ThetaLlama3Model.__new__(ThetaLlama3Model)
    probe.__dict__.update(pm.__dict__)
    probe.state_dict = state
    specs = probe.graph_specs(probe._create_model_config(state))
    spec = specs[GraphRole.DECODER]
    return spec.trace(), _nbytes(spec.weights_registry())


_OP = re.compile(r"=\s*(?:\"?)([a-z_]+\.[a-z_.]*matmul[a-z_.]*)")


def count_matmuls(graph: Graph | str) -> Counter[str]:
    """Matmul ops in a graph's MLIR text, by op name (``rmo.matmul`` ... in MAX 26.7)."""
    text = graph if isinstance(graph, str) else str(graph)
    return Counter(_OP.findall(text))
