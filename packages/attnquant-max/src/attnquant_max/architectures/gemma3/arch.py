"""``Gemma3ForCausalLM``: attnquant's own Gemma 3 text architecture, on MAX's Llama pipeline.

MAX 26.7's Gemma 3 runs in bfloat16 on GPUs only (docs/gemma3-cpu.md). This one is MAX's Llama
architecture (its pipeline, KV cache, batching and tokenizer) under Gemma 3's name, with the
pipeline model that builds Gemma 3's graphs (:mod:`.model`): float32 on a CPU, one device. Its
weight adapter is Llama's (Hugging Face names, ``model.`` taken off), wrapped as every attnquant
architecture's is, so theta checkpoints, NVFP4 and the in-graph paths serve as for Llama.
"""

from __future__ import annotations

import dataclasses

from max.graph.weights import WeightsFormat
from max.pipelines.architectures.llama3 import llama_arch
from max.pipelines.architectures.llama3 import weight_adapters as llama_adapters
from max.pipelines.lib import SupportedArchitecture

from attnquant_core.serving import ServingOptions

from .._loading import uniform_expected, with_adapter
from .graph import Gemma3TextConfig
from .model import Gemma3TextModel

__all__ = ["gemma3_text_architecture"]


def gemma3_text_architecture(options: ServingOptions | None) -> SupportedArchitecture:
    """Gemma 3 text serving ``options`` on every path (its pipeline model builds them)."""
    arch = dataclasses.replace(
        llama_arch,
        name="Gemma3ForCausalLM",
        example_repo_ids=["google/gemma-3-270m", "google/gemma-3-1b-it"],
        multi_gpu_supported=False,
        config=Gemma3TextConfig,
        weight_adapters={WeightsFormat.safetensors: llama_adapters.convert_safetensor_state_dict},
    )
    return with_adapter(
        arch,
        llama_adapters.convert_safetensor_state_dict,
        uniform_expected,
        options,
        in_graph=True,
        pipeline_model=Gemma3TextModel,
    )
