"""Gemma 3 and Gemma 4.

``Gemma3ForCausalLM`` (text) is attnquant's own architecture (:mod:`.gemma3`): every path, float32
on a CPU. The multimodal models, GPU-only in MAX 26.7, keep MAX's graphs (precompute-outside):
``Gemma3ForConditionalGeneration``, ``Gemma4ForConditionalGeneration`` and Gemma 4 12B's
``Gemma4UnifiedForConditionalGeneration`` read ``self.weights`` directly and take no adapter,
so a subclass of their pipeline model swaps the rebuilt weights in before the stock load.
"""

from __future__ import annotations

from max.pipelines.architectures.gemma3multimodal import (
    Gemma3_MultiModalModel as _StockGemma3MultiModalModel,
)
from max.pipelines.architectures.gemma3multimodal import gemma3_multimodal_arch
from max.pipelines.architectures.gemma4 import Gemma3_MultiModalModel as _StockGemma4Model
from max.pipelines.architectures.gemma4 import gemma4_arch, gemma4_unified_arch
from max.pipelines.lib import SupportedArchitecture

from attnquant_core.serving import ServingOptions

from ._loading import RebuildingLoadMixin, uniform_expected, with_adapter
from .gemma3 import gemma3_text_architecture

__all__ = ["Gemma3MultiModalThetaModel", "Gemma4ThetaModel", "gemma_architectures"]


class Gemma3MultiModalThetaModel(RebuildingLoadMixin, _StockGemma3MultiModalModel):
    """Stock Gemma3 (multimodal) pipeline model loading rebuilt weights."""


class Gemma4ThetaModel(RebuildingLoadMixin, _StockGemma4Model):
    """Stock Gemma4 pipeline model loading rebuilt weights."""


def gemma_architectures(options: ServingOptions | None) -> list[SupportedArchitecture]:
    """Gemma 3 (text), Gemma 3 and Gemma 4 (multimodal) serving ``options``.

    The multimodal models are handed an attnquant adapter all the same, never called, to carry
    ``options`` to :class:`~._loading.RebuildingLoadMixin`.
    """
    carrier = (None, uniform_expected, options)
    return [
        gemma3_text_architecture(options),
        with_adapter(gemma3_multimodal_arch, *carrier, pipeline_model=Gemma3MultiModalThetaModel),
        with_adapter(gemma4_arch, *carrier, pipeline_model=Gemma4ThetaModel),
        # Gemma 4 12B ("gemma4_unified"): the Gemma 4 model and loader, served text-only.
        with_adapter(gemma4_unified_arch, *carrier, pipeline_model=Gemma4ThetaModel),
    ]
