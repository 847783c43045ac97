"""Gemma 3 text's pipeline model: the attnquant Llama pipeline model building Gemma 3's graphs.

MAX's Llama pipeline model (:class:`~..llama3.model.ThetaLlama3Model`) runs everything a text
decoder needs around the graph: the one paged KV cache, the inputs, the last-token and echo
logits. This one builds :class:`~.graph.Gemma3Text` (dense), :class:`~.graph.ThetaGemma3` and
:class:`~.graph.NVFP4Gemma3` instead of the Llama models, from a :class:`~.graph.Gemma3TextConfig`.
"""

from __future__ import annotations

from typing import Any

from max.pipelines.lib.graph_specs import GraphRole, GraphSpec

from ..llama3.model import ThetaLlama3Model
from .graph import Gemma3Text, Gemma3TextConfig, NVFP4Gemma3, ThetaGemma3

__all__ = ["Gemma3TextModel"]


class Gemma3TextModel(ThetaLlama3Model):
    """Gemma 3 text on one device, on every attnquant path (see the module docstring)."""

    theta_model = ThetaGemma3
    nvfp4_model = NVFP4Gemma3
    graph_name = "gemma3"
    model_config_cls = Gemma3TextConfig
    config_class = Gemma3TextConfig

    def _dense_specs(self, model_config: Any) -> dict[str, GraphSpec]:
        self._single_device("Gemma 3 is served by attnquant on one device", model_config)
        return {GraphRole.DECODER: self._spec(model_config, Gemma3Text(model_config))}
