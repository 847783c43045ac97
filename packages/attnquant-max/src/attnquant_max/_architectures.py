"""MAX architectures that serve theta checkpoints.

Each one is a stock MAX architecture under its stock name (so ``config.json``
stays readable by transformers, and registering it overrides the built-in),
changed in how weights are loaded (:mod:`._adapter`, one plan per load: :mod:`._plan`). On the precompute-outside
path the model, its graph and its kernels are MAX's.

* ``LlamaForCausalLM`` and ``Gemma3ForCausalLM`` load through a weight adapter:
  their stock adapters are wrapped. ``LlamaForCausalLM`` also serves the
  in-graph paths (GEMM formulation, in-graph precompute): its pipeline model
  (:class:`~attnquant_max._ingraph.ThetaLlama3Model`) builds the theta model
  when the adapter hands it theta tensors. The other architectures refuse those
  paths at load.
* ``Gemma3ForConditionalGeneration``, ``Gemma4ForConditionalGeneration`` and
  ``Gemma4UnifiedForConditionalGeneration`` (Gemma 4 12B) read ``self.weights`` directly and take no adapter in MAX 26.7, so a subclass
  of their pipeline model swaps the rebuilt weights in before the stock load.

Gemma3/Gemma4 are GPU-only in MAX (bf16 encodings); only Llama runs on CPU.
Importing this module imports ``max.pipelines`` (~15 s): MAX does it when it
loads ``--custom-architectures``; nothing else in attnquant-max does at import.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

from max.graph.weights import WeightsFormat
from max.pipelines.architectures.gemma3 import gemma3_arch
from max.pipelines.architectures.gemma3 import weight_adapters as gemma3_adapters
from max.pipelines.architectures.gemma3multimodal import (
    Gemma3_MultiModalModel as _StockGemma3MultiModalModel,
)
from max.pipelines.architectures.gemma3multimodal import gemma3_multimodal_arch
from max.pipelines.architectures.gemma4 import Gemma3_MultiModalModel as _StockGemma4Model
from max.pipelines.architectures.gemma4 import gemma4_arch, gemma4_unified_arch
from max.pipelines.architectures.llama3 import llama_arch
from max.pipelines.architectures.llama3 import weight_adapters as llama_adapters
from max.pipelines.lib import SupportedArchitecture

from attnquant_core.serving import ServingOptions

from ._adapter import ArrayWeights, rebuilt_weights, wrap_weight_adapter
from ._ingraph import ThetaLlama3Model
from ._keys import (
    check_state_keys,
    expected_layer_type_keys,
    expected_llama_keys,
    expected_uniform_keys,
)

__all__ = ["ARCHITECTURES", "build_architectures"]


def _text_config(hf_config: Any) -> Any:
    return getattr(hf_config, "text_config", None) or hf_config


def _llama_expected(hf_config: Any, state: Mapping[str, Any]) -> set[str]:
    return expected_llama_keys(hf_config)


def _uniform_expected(hf_config: Any, state: Mapping[str, Any]) -> set[str]:
    return expected_uniform_keys(state.keys(), int(_text_config(hf_config).num_hidden_layers))


class _WeightsMap:
    """Rebuilt weights in the shape of MAX's ``Weights`` as the Gemma models read them."""

    def __init__(self, weights: dict[str, ArrayWeights], original: Any) -> None:
        self._weights = weights
        self._original = original

    def items(self) -> Iterator[tuple[str, Any]]:
        return iter(self._weights.items())

    def close(self) -> None:
        close = getattr(self._original, "close", None)
        if close is not None:
            close()


class _RebuildingLoadMixin:
    """Swap ``self.weights`` for the rebuilt state before the stock ``_load_state_dict``.

    Checked here, in Hugging Face names: a theta checkpoint rebuilds exactly its source's keys
    (:func:`rebuilt_weights`), no theta key is left, and layers of one type hold the same
    weights. Gemma 4's layers are alike only within a type (its global layers may have another
    head size and share k and v), so the per-layer set is taken per ``layer_types`` entry.
    """

    weights: Any
    pipeline_config: Any
    huggingface_config: Any

    def _load_state_dict(self) -> dict[str, Any]:
        weights, plan = rebuilt_weights(
            dict(self.weights.items()),
            self.pipeline_config,
            options=getattr(getattr(self, "adapter", None), "options", None),
            name=type(self).__name__,
        )
        text = _text_config(self.huggingface_config)
        num_layers = int(getattr(text, "num_hidden_layers", 0) or plan.num_layers)
        expected = expected_layer_type_keys(
            weights.keys(), num_layers, getattr(text, "layer_types", None)
        )
        check_state_keys(weights, expected, model_path=plan.model_path)
        if plan.rebuilds:
            self.weights = _WeightsMap(weights, self.weights)
        return super()._load_state_dict()  # type: ignore[misc]


class Gemma3MultiModalThetaModel(_RebuildingLoadMixin, _StockGemma3MultiModalModel):
    """Stock Gemma3 (multimodal) pipeline model loading rebuilt weights."""


class Gemma4ThetaModel(_RebuildingLoadMixin, _StockGemma4Model):
    """Stock Gemma4 pipeline model loading rebuilt weights."""


def _with_adapter(
    arch: SupportedArchitecture,
    stock: Any,
    expected: Any,
    options: ServingOptions | None,
    *,
    in_graph: bool = False,
    **replace: Any,
) -> SupportedArchitecture:
    adapter = wrap_weight_adapter(
        stock, expected, name=arch.name, in_graph=in_graph, options=options
    )
    # Other weight formats (GGUF: MAX's CPU q4_0/q4_k Llama) keep the stock adapters: theta
    # checkpoints are safetensors only, and a GGUF checkpoint is served as MAX serves it.
    adapters = {**arch.weight_adapters, WeightsFormat.safetensors: adapter}
    return dataclasses.replace(arch, weight_adapters=adapters, **replace)


def build_architectures(options: ServingOptions | None = None) -> list[SupportedArchitecture]:
    """The attnquant variants of the stock MAX architectures, stock names kept, every load
    through them serving ``options`` (``None``: the ``ATTNQUANT_*`` variables at each load).

    The Gemma multimodal models read ``self.weights`` and take no adapter in MAX 26.7; they
    are handed an attnquant adapter all the same, never called, to carry ``options`` to
    :class:`_RebuildingLoadMixin`.
    """
    carrier = (None, _uniform_expected, options)
    return [
        _with_adapter(
            llama_arch,
            llama_adapters.convert_safetensor_state_dict,
            _llama_expected,
            options,
            in_graph=True,
            pipeline_model=ThetaLlama3Model,
        ),
        _with_adapter(
            gemma3_arch, gemma3_adapters.convert_safetensor_state_dict, _uniform_expected, options
        ),
        _with_adapter(gemma3_multimodal_arch, *carrier, pipeline_model=Gemma3MultiModalThetaModel),
        _with_adapter(gemma4_arch, *carrier, pipeline_model=Gemma4ThetaModel),
        # Gemma 4 12B ("gemma4_unified"): the Gemma 4 model and loader, served text-only.
        _with_adapter(gemma4_unified_arch, *carrier, pipeline_model=Gemma4ThetaModel),
    ]


#: What ``max serve --custom-architectures`` registers: the options of this process, read
#: once from its ``ATTNQUANT_*`` variables (``attnquant serve`` writes them for its child).
ARCHITECTURES: list[SupportedArchitecture] = build_architectures(ServingOptions.from_env())
