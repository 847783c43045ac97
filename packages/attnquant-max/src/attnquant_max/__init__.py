"""attnquant-max: serve attnquant theta checkpoints through Modular MAX.

The production path is *precompute-outside* (DESIGN §5.1): every projection is
rebuilt once at load, ``W_eff = diag(s) W0 + U V^T``, and handed to the stock MAX
model under its stock key, so the served graph is the base model's. The MAX
architectures doing this live in the folder :func:`architectures_path` returns::

    max serve --model-path THETA_DIR --custom-architectures $(python -c \\
        "import attnquant_max; print(attnquant_max.architectures_path())") \\
        --devices cpu --quantization-encoding float32

With ``ATTNQUANT_PRECOMPUTE_OUTSIDE=0`` (GEMM formulation, DESIGN §5.2) or
``ATTNQUANT_PRECOMPUTE=1`` (``W_eff`` formed in the graph) the Llama
architecture builds an in-graph model instead: the theta tensors are the
graph's weights, each band's ``W0`` held once (:class:`ThetaLinear` and friends).

Runtime options are the ``ATTNQUANT_*`` variables, parsed by
:meth:`AttnquantConfig.from_env`. Importing this package does not import
``max.pipelines`` (slow); :func:`load_pipeline` does, when called.
"""

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from ._config import (
    ENV_VARIABLES,
    PATH_DESCRIPTIONS,
    AttnquantConfig,
    ConfigError,
    require_implemented,
    serving_path,
    use_gemm_formulation,
)
from ._eval import (
    ECHO_OVERRIDES,
    evaluate_max,
    load_echo_pipeline,
    max_unavailable,
    planned_length,
    window_logprobs,
)
from ._export import ExportProgress, export_nvfp4
from ._generate import (
    AGREEMENT_THRESHOLD,
    DELTA_THRESHOLD,
    NEAR_TIE,
    LoadedModel,
    ParityReport,
    TokenScores,
    greedy_generate,
    greedy_logprobs,
    load_pipeline,
    logit_parity,
)
from ._layout import InGraphLayout, ingraph_tensors
from ._nvfp4 import (
    BLOCK_SIZE,
    E2M1_VALUES,
    E4M3_VALUES,
    NVFP4Error,
    NVFP4Tensor,
    dequantize_nvfp4,
    nvfp4_error_bound,
    quantize_nvfp4,
)
from ._serve import architectures_path, max_entrypoint, serve_command, serve_env
from ._weights import (
    ServingPlan,
    ThetaWeightAdapter,
    WeightKeyError,
    check_state_keys,
    config_override,
    current_config,
    log_serving_path,
    plan_serving,
    wrap_weight_adapter,
)

try:
    __version__ = version("attnquant-max")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = [
    # runtime configuration (ATTNQUANT_* variables) and path selection
    "ENV_VARIABLES",
    "AttnquantConfig",
    "ConfigError",
    "PATH_DESCRIPTIONS",
    "require_implemented",
    "serving_path",
    "use_gemm_formulation",
    # in-graph paths: theta layers for MAX graphs, the theta Llama, measurements
    "InGraphLayout",
    "ThetaBuilder",
    "ThetaLinear",
    "ThetaLlama3",
    "ThetaLlama3Model",
    "ThetaMLP",
    "ThetaSharedBlocks",
    "ThetaStackedLinear",
    "count_matmuls",
    "decoder_graph",
    "ingraph_tensors",
    # precompute-outside serving: MAX architectures, the load plan, key checks
    "ServingPlan",
    "ThetaWeightAdapter",
    "WeightKeyError",
    "architectures_path",
    "check_state_keys",
    "config_override",
    "current_config",
    "log_serving_path",
    "plan_serving",
    "wrap_weight_adapter",
    # the OpenAI-compatible server
    "max_entrypoint",
    "serve_command",
    "serve_env",
    # judging by function through MAX: all-position logits of an echo model
    "ECHO_OVERRIDES",
    "evaluate_max",
    "load_echo_pipeline",
    "max_unavailable",
    "planned_length",
    "window_logprobs",
    # in-process generation and logit parity
    "AGREEMENT_THRESHOLD",
    "DELTA_THRESHOLD",
    "NEAR_TIE",
    "LoadedModel",
    "ParityReport",
    "TokenScores",
    "greedy_generate",
    "greedy_logprobs",
    "load_pipeline",
    "logit_parity",
    # NVFP4: numpy reference and Model Optimizer export
    "BLOCK_SIZE",
    "E2M1_VALUES",
    "E4M3_VALUES",
    "ExportProgress",
    "NVFP4Error",
    "NVFP4Tensor",
    "dequantize_nvfp4",
    "export_nvfp4",
    "nvfp4_error_bound",
    "quantize_nvfp4",
    # metadata
    "__version__",
]

# The MAX graph layers import max.nn (and the theta Llama max.pipelines, ~15 s):
# loaded on first use, so `import attnquant_max` stays fast.
_LAZY = {
    "ThetaBuilder": "._layers",
    "ThetaLinear": "._layers",
    "ThetaMLP": "._layers",
    "ThetaSharedBlocks": "._layers",
    "ThetaStackedLinear": "._layers",
    "ThetaLlama3": "._ingraph",
    "ThetaLlama3Model": "._ingraph",
    "count_matmuls": "._ingraph",
    "decoder_graph": "._ingraph",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from importlib import import_module

        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
