"""Gemma 3 text: the architecture (:mod:`.arch`), the pipeline model (:mod:`.model`), the graphs
(:mod:`.graph`). Importing it imports ``max.pipelines`` (~15 s)."""

from .arch import gemma3_text_architecture
from .graph import Gemma3Text, NVFP4Gemma3, ThetaGemma3
from .model import Gemma3TextModel

__all__ = [
    "Gemma3Text",
    "Gemma3TextModel",
    "NVFP4Gemma3",
    "ThetaGemma3",
    "gemma3_text_architecture",
]
