"""attnquant-max: serve attnquant theta checkpoints through Modular MAX.

The production path is *precompute-outside* (DESIGN §5.1): every projection is
rebuilt once at load, ``W_eff = diag(s) W0 + U V^T``, and handed to the stock MAX
model under its stock key, so the served graph is the base model's. The MAX
architectures doing this live in the folder :func:`architectures_path` returns::

    max serve --model-path THETA_DIR --custom-architectures $(python -c \\
        "import attnquant_max; print(attnquant_max.architectures_path())") \\
        --devices cpu --quantization-encoding float32

Runtime options are the ``ATTNQUANT_*`` variables, parsed by
:meth:`AttnquantConfig.from_env`. Importing this package does not import
``max.pipelines`` (slow); :func:`load_pipeline` does, when called.
"""

from importlib.metadata import PackageNotFoundError, version

from ._config import (
    ENV_VARIABLES,
    AttnquantConfig,
    ConfigError,
    require_implemented,
    use_gemm_formulation,
)
from ._generate import (
    AGREEMENT_THRESHOLD,
    DELTA_THRESHOLD,
    LoadedModel,
    ParityReport,
    TokenScores,
    greedy_generate,
    greedy_logprobs,
    load_pipeline,
    logit_parity,
)
from ._export import ExportProgress, export_nvfp4
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
    "require_implemented",
    "use_gemm_formulation",
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
    # in-process generation and logit parity
    "AGREEMENT_THRESHOLD",
    "DELTA_THRESHOLD",
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
