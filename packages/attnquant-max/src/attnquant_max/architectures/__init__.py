"""MAX architectures that serve theta checkpoints, one folder or module per architecture.

Each is a stock MAX architecture under its stock name (so ``config.json`` stays readable by
transformers, and registering it overrides the built-in), changed in how weights are loaded:
the weight adapter (:mod:`attnquant_max._adapter`) makes one plan per load
(:mod:`attnquant_max._plan`) from the options it carries. On the precompute-outside path the
model, its graph and its kernels are MAX's.

* :mod:`.llama3` (``LlamaForCausalLM``): also the in-graph paths; its pipeline model builds the
  theta model when the plan asks for one.
  ``MistralForCausalLM`` is the same architecture under Mistral's name.
* :mod:`.gemma3` (``Gemma3ForCausalLM``): attnquant's own Gemma 3 text graph, every path.
* :mod:`.gemma` (Gemma 3 multimodal and Gemma 4, GPU-only in MAX): precompute-outside only.
* :mod:`.qwen` (``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``): MAX's graphs, precompute-outside.

Importing this package imports ``max.pipelines`` (~15 s): MAX does it when it loads
``--custom-architectures`` (the folder :func:`attnquant_max.architectures_path` returns, whose
module binds the architectures to the process's ``ATTNQUANT_*`` variables), and
:func:`attnquant_max.load_pipeline` when it registers them bound to a load's options.
"""

from __future__ import annotations

from max.pipelines.lib import SupportedArchitecture

from attnquant_core.serving import ServingOptions

from .gemma import gemma_architectures
from .llama3 import llama_architecture, mistral_architecture
from .qwen import qwen_architectures

__all__ = ["build_architectures"]


def build_architectures(options: ServingOptions | None = None) -> list[SupportedArchitecture]:
    """The attnquant variants of the stock MAX architectures, stock names kept, every load
    through them serving ``options`` (``None``: the ``ATTNQUANT_*`` variables at each load)."""
    return [
        llama_architecture(options),
        mistral_architecture(options),
        *gemma_architectures(options),
        *qwen_architectures(options),
    ]
