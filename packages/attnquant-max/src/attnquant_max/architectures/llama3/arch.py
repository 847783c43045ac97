"""``LlamaForCausalLM``: MAX's Llama 3 architecture, its adapter wrapped, its pipeline model the
one that builds the in-graph theta model (:mod:`.model`). ``MistralForCausalLM`` (Mistral's text
models: a Llama decoder, ``head_dim`` and ``rope_theta`` of their own) is the same architecture
under Mistral's name; MAX 26.7's own Mistral runs in bfloat16 on GPUs only. Its sliding window,
where the config sets one, is refused past the window (:func:`attnquant_max._config.require_device`):
up to it full attention is the same computation."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from max.pipelines.architectures.llama3 import llama_arch
from max.pipelines.architectures.llama3 import weight_adapters as llama_adapters
from max.pipelines.lib import SupportedArchitecture

from attnquant_core.serving import ServingOptions

from ..._keys import expected_llama_keys
from .._loading import with_adapter
from .model import ThetaLlama3Model

__all__ = ["llama_architecture", "mistral_architecture"]


def _llama_expected(hf_config: Any, state: Mapping[str, Any]) -> set[str]:
    return expected_llama_keys(hf_config)


def llama_architecture(options: ServingOptions | None) -> SupportedArchitecture:
    """Llama 3 serving ``options``: the in-graph paths too (its pipeline model builds them)."""
    return with_adapter(
        llama_arch,
        llama_adapters.convert_safetensor_state_dict,
        _llama_expected,
        options,
        in_graph=True,
        pipeline_model=ThetaLlama3Model,
    )


def mistral_architecture(options: ServingOptions | None) -> SupportedArchitecture:
    """Mistral text serving ``options`` on every path: Llama 3's architecture under its name."""
    arch = dataclasses.replace(
        llama_arch,
        name="MistralForCausalLM",
        example_repo_ids=["mistralai/Mistral-7B-Instruct-v0.3"],
    )
    return with_adapter(
        arch,
        llama_adapters.convert_safetensor_state_dict,
        _llama_expected,
        options,
        in_graph=True,
        pipeline_model=ThetaLlama3Model,
    )
