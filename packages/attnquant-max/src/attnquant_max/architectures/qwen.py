"""Qwen2 and Qwen3 text: MAX's own graphs, float32 on a CPU, theta rebuilt at load.

MAX 26.7 serves ``Qwen2ForCausalLM`` (its Llama 3 graph with q/k/v biases) and
``Qwen3ForCausalLM`` (q/k norms) in float32 as well as bfloat16, so on a CPU they need no graph
of attnquant's: their stock adapters are wrapped, as every attnquant architecture's are, and a
theta checkpoint is served on the precompute-outside path (every family rebuilt once at load,
then MAX's graph). The in-graph paths and NVFP4 are refused for them in one line
(:func:`attnquant_max._adapter.rebuilt_weights`). Their sliding windows, where a config turns
them on, are refused past the window (:func:`attnquant_max._config.require_device`).
"""

from __future__ import annotations

from max.pipelines.architectures.llama3 import weight_adapters as llama_adapters
from max.pipelines.architectures.qwen2 import qwen2_arch
from max.pipelines.architectures.qwen3 import qwen3_arch
from max.pipelines.lib import SupportedArchitecture

from attnquant_core.serving import ServingOptions

from ._loading import uniform_expected, with_adapter

__all__ = ["qwen_architectures"]


def qwen_architectures(options: ServingOptions | None) -> list[SupportedArchitecture]:
    """Qwen2 and Qwen3 text serving ``options`` (precompute-outside: MAX's graphs)."""
    stock = llama_adapters.convert_safetensor_state_dict  # what both stock archs use
    return [
        with_adapter(arch, stock, uniform_expected, options) for arch in (qwen2_arch, qwen3_arch)
    ]
