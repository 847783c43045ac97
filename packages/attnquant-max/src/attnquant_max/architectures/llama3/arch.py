"""``LlamaForCausalLM``: MAX's Llama 3 architecture, its adapter wrapped, its pipeline model the
one that builds the in-graph theta model (:mod:`.model`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from max.pipelines.architectures.llama3 import llama_arch
from max.pipelines.architectures.llama3 import weight_adapters as llama_adapters
from max.pipelines.lib import SupportedArchitecture

from attnquant_core.serving import ServingOptions

from ..._keys import expected_llama_keys
from .._loading import with_adapter
from .model import ThetaLlama3Model

__all__ = ["llama_architecture"]


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
