"""attnquant-max: serve attnquant theta checkpoints through Modular MAX.

Every load is made from one :class:`ServingOptions` value (CLI flags, or the ``ATTNQUANT_*``
variables for compatibility) and turned into one :class:`ServingPlan` by :func:`plan_serving`;
the weight adapter of attnquant's MAX architectures hands MAX the state that plan implies, and
the graph builder reads the same plan. ``--path auto`` (the default) follows the checkpoint: a
dense or passthrough checkpoint is served on the stock graph, every ``W_eff = diag(s) W0 + U V^T``
rebuilt once at load (precompute-outside); a compressed theta checkpoint of a Llama model is
served in the graph holding its own bytes (GEMM formulation or the custom op, as measured faster
on the device; docs/serving-paths.md). The MAX architectures live in the folder
:func:`architectures_path` returns::

    max serve --model-path THETA_DIR --custom-architectures $(python -c \\
        "import attnquant_max; print(attnquant_max.architectures_path())") \\
        --devices cpu --quantization-encoding float32

Importing this package does not import ``max.pipelines`` (slow); :func:`load_pipeline` does,
when called.
"""

from importlib.metadata import PackageNotFoundError, version
from typing import Any

# Re-exported from attnquant-core, where they live (numpy only): the public API stays.
from attnquant_core.forms import (
    BLOCK_SIZE,
    E2M1_VALUES,
    E4M3_VALUES,
    NVFP4Error,
    NVFP4Tensor,
    dequantize_nvfp4,
    nvfp4_error_bound,
    quantize_nvfp4,
)
from attnquant_core.io import ExportProgress, export_nvfp4
from attnquant_core.serving import (
    OPTIONS,
    ConfigError,
    InGraphLayout,
    OptionSpec,
    ServingOptions,
    ingraph_tensors,
    options_table,
)

from ._adapter import PlannedState, ThetaWeightAdapter, wrap_weight_adapter
from ._config import (
    PATH_DESCRIPTIONS,
    DeviceError,
    require_device,
    require_implemented,
    serving_path,
    use_gemm_formulation,
)
from ._eval import (
    ECHO_OVERRIDES,
    evaluate_max,
    load_decode_pipeline,
    load_echo_pipeline,
    max_unavailable,
    planned_length,
    window_logprobs,
)
from ._generate import (
    AGREEMENT_THRESHOLD,
    DELTA_THRESHOLD,
    NEAR_TIE,
    STOCK,
    LoadedModel,
    ParityReport,
    TokenScores,
    decode_logprobs,
    decode_step_logits,
    greedy_generate,
    greedy_logprobs,
    load_pipeline,
    logit_parity,
)
from ._keys import WeightKeyError, check_state_keys
from ._plan import ServingPlan, log_serving_path, plan_serving
from ._serve import architectures_path, max_entrypoint, serve_command, serve_env

try:
    __version__ = version("attnquant-max")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = [
    # serving options (CLI flags, ATTNQUANT_* variables) and path selection
    "OPTIONS",
    "ConfigError",
    "DeviceError",
    "OptionSpec",
    "PATH_DESCRIPTIONS",
    "ServingOptions",
    "options_table",
    "require_device",
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
    # one plan per load: the weight adapter, its state, key checks
    "PlannedState",
    "ServingPlan",
    "ThetaWeightAdapter",
    "WeightKeyError",
    "architectures_path",
    "check_state_keys",
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
    "load_decode_pipeline",
    "load_echo_pipeline",
    "max_unavailable",
    "planned_length",
    "window_logprobs",
    # in-process generation and logit parity
    "AGREEMENT_THRESHOLD",
    "DELTA_THRESHOLD",
    "NEAR_TIE",
    "STOCK",
    "LoadedModel",
    "ParityReport",
    "TokenScores",
    "greedy_generate",
    "decode_logprobs",
    "decode_step_logits",
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
    "ThetaLlama3": ".architectures.llama3",
    "ThetaLlama3Model": ".architectures.llama3",
    "count_matmuls": ".architectures.llama3",
    "decoder_graph": ".architectures.llama3",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from importlib import import_module

        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
