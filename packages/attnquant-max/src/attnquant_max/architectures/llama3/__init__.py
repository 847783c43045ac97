"""Llama 3: the architecture (:mod:`.arch`), the pipeline model (:mod:`.model`), the theta graph
(:mod:`.graph`). Importing it imports ``max.pipelines`` (~15 s)."""

from .arch import llama_architecture, mistral_architecture
from .graph import NVFP4Llama3, ThetaLlama3
from .model import ThetaLlama3Model, count_matmuls, decoder_graph

__all__ = [
    "NVFP4Llama3",
    "ThetaLlama3",
    "ThetaLlama3Model",
    "count_matmuls",
    "decoder_graph",
    "llama_architecture",
    "mistral_architecture",
]
