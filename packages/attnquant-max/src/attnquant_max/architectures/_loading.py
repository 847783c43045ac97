"""What every attnquant architecture shares: the stock adapter wrapped with options, and the
load-time swap of the models that take no adapter (Gemma 3 and 4 multimodal in MAX 26.7)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

from max.graph.weights import WeightsFormat
from max.pipelines.lib import SupportedArchitecture

from attnquant_core.serving import ServingOptions

from .._adapter import ArrayWeights, rebuilt_weights, wrap_weight_adapter
from .._keys import check_state_keys, expected_layer_type_keys, expected_uniform_keys

__all__ = ["RebuildingLoadMixin", "text_config", "uniform_expected", "with_adapter"]


def text_config(hf_config: Any) -> Any:
    return getattr(hf_config, "text_config", None) or hf_config


def uniform_expected(hf_config: Any, state: Mapping[str, Any]) -> set[str]:
    return expected_uniform_keys(state.keys(), int(text_config(hf_config).num_hidden_layers))


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


class RebuildingLoadMixin:
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
        text = text_config(self.huggingface_config)
        num_layers = int(getattr(text, "num_hidden_layers", 0) or plan.num_layers)
        expected = expected_layer_type_keys(
            weights.keys(), num_layers, getattr(text, "layer_types", None)
        )
        check_state_keys(weights, expected, model_path=plan.model_path)
        if plan.rebuilds:
            self.weights = _WeightsMap(weights, self.weights)
        return super()._load_state_dict()  # type: ignore[misc]


def with_adapter(
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
