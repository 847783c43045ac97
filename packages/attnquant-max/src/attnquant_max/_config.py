"""Runtime configuration: every ``ATTNQUANT_*`` variable, parsed once.

The table of variables is DESIGN §3. :meth:`AttnquantConfig.from_env` reads an
environment mapping (``os.environ`` by default) and fails on the first bad value
with a :class:`ConfigError` that names the variable, the value and what is
allowed, so a typo stops the server at start-up instead of serving something
else.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = [
    "ENV_VARIABLES",
    "PATH_DESCRIPTIONS",
    "AttnquantConfig",
    "ConfigError",
    "DeviceError",
    "GPU_ONLY_ARCHITECTURES",
    "ServingPath",
    "require_device",
    "require_implemented",
    "serving_path",
    "use_gemm_formulation",
]

from attnquant_kernels import MAX_RANK

logger = logging.getLogger(__name__)

Passthrough = Literal["layers"]
Quant = Literal["nvfp4"]
NVFP4Kernel = Literal["auto", "fused", "dequantize"]
NVFP4_KERNELS: tuple[str, ...] = ("auto", "fused", "dequantize")

#: Every variable this package reads, with its default as a user would write it.
ENV_VARIABLES: dict[str, str] = {
    "ATTNQUANT_BLOCKS": "unset (the caller's default)",
    "ATTNQUANT_RANK": "16",
    "ATTNQUANT_PRECOMPUTE_OUTSIDE": "1",
    "ATTNQUANT_PRECOMPUTE": "0",
    "ATTNQUANT_GEMM": "unset (auto)",
    "ATTNQUANT_QKV_FUSE": "1",
    "ATTNQUANT_FUSED_MLP": "1",
    "ATTNQUANT_QUANT": "unset",
    "ATTNQUANT_NVFP4_KERNEL": "auto",
    "ATTNQUANT_QUANT_HEAD": "0",
}

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_BOOL_ALLOWED = "one of 1/0, true/false, yes/no, on/off"

# Largest rank the custom op (`generated_linear`) accepts; above it the GEMM
# formulation is the only in-graph path. One number, attnquant-kernels' own.
CUSTOM_OP_MAX_RANK = MAX_RANK


class ConfigError(ValueError):
    """An ``ATTNQUANT_*`` variable holds a value that is not allowed."""

    def __init__(self, variable: str, value: str, allowed: str) -> None:
        self.variable = variable
        self.value = value
        self.allowed = allowed
        super().__init__(f"{variable}={value!r} is not valid: expected {allowed}.")


def _get(env: Mapping[str, str], name: str) -> str | None:
    """The stripped value of ``name``; an empty string counts as unset."""
    raw = env.get(name)
    if raw is None or not raw.strip():
        return None
    return raw.strip()


def _parse_bool(env: Mapping[str, str], name: str, default: bool | None) -> bool | None:
    raw = _get(env, name)
    if raw is None:
        return default
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise ConfigError(name, raw, _BOOL_ALLOWED + (" or unset (auto)" if default is None else ""))


def _whole_number(name: str, raw: str, *, minimum: int, allowed: str) -> int:
    """``raw`` as an int of at least ``minimum``, else a ConfigError naming the variable."""
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(name, raw, allowed) from None
    if value < minimum:
        raise ConfigError(name, raw, allowed)
    return value


def _parse_blocks(env: Mapping[str, str]) -> int | Passthrough | None:
    name = "ATTNQUANT_BLOCKS"
    raw = _get(env, name)
    if raw is None:
        return None
    if raw.lower() == "layers":
        return "layers"
    allowed = "a whole number >= 1, or 'layers' for passthrough (one block per layer)"
    return _whole_number(name, raw, minimum=1, allowed=allowed)


def _parse_rank(env: Mapping[str, str]) -> int:
    name = "ATTNQUANT_RANK"
    raw = _get(env, name)
    if raw is None:
        return 16
    return _whole_number(name, raw, minimum=0, allowed="a whole number >= 0")


def _parse_quant(env: Mapping[str, str]) -> Quant | None:
    name = "ATTNQUANT_QUANT"
    raw = _get(env, name)
    if raw is None:
        return None
    if raw.lower() == "nvfp4":
        return "nvfp4"
    raise ConfigError(name, raw, "'nvfp4' or unset (no quantization)")


def _parse_nvfp4_kernel(env: Mapping[str, str]) -> NVFP4Kernel:
    name = "ATTNQUANT_NVFP4_KERNEL"
    raw = _get(env, name)
    if raw is None:
        return "auto"
    if raw.lower() in NVFP4_KERNELS:
        return raw.lower()  # type: ignore[return-value]
    raise ConfigError(name, raw, "one of auto, fused, dequantize")


@dataclass(frozen=True, kw_only=True)
class AttnquantConfig:
    """The runtime configuration of DESIGN §3, one field per variable.

    Attributes
    ----------
    blocks : int, "layers" or None
        ``ATTNQUANT_BLOCKS``: number of shared blocks ``G``; ``"layers"`` is
        passthrough; ``None`` (unset) means "the caller's default" (``1`` for
        analysis, passthrough when serving a dense checkpoint).
    rank : int
        ``ATTNQUANT_RANK``: rank ``r`` of the correction.
    precompute_outside : bool
        ``ATTNQUANT_PRECOMPUTE_OUTSIDE``: rebuild ``W_eff`` once at load.
    precompute : bool
        ``ATTNQUANT_PRECOMPUTE``: rebuild ``W_eff`` inside the graph.
    gemm : bool or None
        ``ATTNQUANT_GEMM``: in-graph formulation, ``None`` = automatic.
    qkv_fuse : bool
        ``ATTNQUANT_QKV_FUSE``: GEMM path batches q/k/v into two dispatches.
    fused_mlp : bool
        ``ATTNQUANT_FUSED_MLP``: custom-op path runs the MLP in one dispatch.
    quant : "nvfp4" or None
        ``ATTNQUANT_QUANT``: quantize each ``W_eff`` at load.
    nvfp4_kernel : "auto", "fused" or "dequantize"
        ``ATTNQUANT_NVFP4_KERNEL``: how NVFP4 projections run: ``fused`` one
        ``generated_linear_nvfp4`` dispatch reading the packed bytes, ``dequantize`` the
        weight dequantized in the graph then a matmul, ``auto`` whichever is faster when
        timed once at start-up (logged).
    quant_head : bool
        ``ATTNQUANT_QUANT_HEAD``: the output head in NVFP4 too, beside NVFP4 projections
        (``ATTNQUANT_QUANT=nvfp4``) or on an in-graph path (``ATTNQUANT_PRECOMPUTE_OUTSIDE=0``,
        any theta checkpoint: a budget fit's float forms too); off by default, as in Model
        Optimizer's NVFP4 checkpoints, which keep ``lm_head`` in full precision. A tied head is quantized from the embedding table, which stays float.
    """

    blocks: int | Passthrough | None = None
    rank: int = 16
    precompute_outside: bool = True
    precompute: bool = False
    gemm: bool | None = None
    qkv_fuse: bool = True
    fused_mlp: bool = True
    quant: Quant | None = None
    nvfp4_kernel: NVFP4Kernel = "auto"
    quant_head: bool = False

    def __post_init__(self) -> None:
        if self.blocks is not None and self.blocks != "layers":
            if isinstance(self.blocks, bool) or not isinstance(self.blocks, int):
                raise ConfigError("ATTNQUANT_BLOCKS", str(self.blocks), "an int >= 1 or 'layers'")
            if self.blocks < 1:
                raise ConfigError("ATTNQUANT_BLOCKS", str(self.blocks), "an int >= 1 or 'layers'")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ConfigError("ATTNQUANT_RANK", str(self.rank), "a whole number >= 0")
        if self.quant not in (None, "nvfp4"):
            raise ConfigError("ATTNQUANT_QUANT", str(self.quant), "'nvfp4' or unset")
        if self.nvfp4_kernel not in NVFP4_KERNELS:
            raise ConfigError(
                "ATTNQUANT_NVFP4_KERNEL", str(self.nvfp4_kernel), "one of auto, fused, dequantize"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> AttnquantConfig:
        """Parse every ``ATTNQUANT_*`` variable of ``env`` (``os.environ`` by default).

        Raises
        ------
        ConfigError
            A variable holds a value that is not allowed; the message names the
            variable, the value and what is allowed.
        """
        env = os.environ if env is None else env
        return cls(
            blocks=_parse_blocks(env),
            rank=_parse_rank(env),
            precompute_outside=bool(_parse_bool(env, "ATTNQUANT_PRECOMPUTE_OUTSIDE", True)),
            precompute=bool(_parse_bool(env, "ATTNQUANT_PRECOMPUTE", False)),
            gemm=_parse_bool(env, "ATTNQUANT_GEMM", None),
            qkv_fuse=bool(_parse_bool(env, "ATTNQUANT_QKV_FUSE", True)),
            fused_mlp=bool(_parse_bool(env, "ATTNQUANT_FUSED_MLP", True)),
            quant=_parse_quant(env),
            nvfp4_kernel=_parse_nvfp4_kernel(env),
            quant_head=bool(_parse_bool(env, "ATTNQUANT_QUANT_HEAD", False)),
        )

    @property
    def passthrough(self) -> bool:
        """Whether ``blocks`` asks for passthrough (``G = L``) explicitly."""
        return self.blocks == "layers"


ServingPath = Literal["precompute-outside", "gemm", "precompute", "custom-op"]

#: What each execution path is, for the start-up log.
PATH_DESCRIPTIONS: dict[str, str] = {
    "precompute-outside": "precompute-outside: W_eff = s*W0 + U V^T rebuilt once at load, "
    "stock MAX graph",
    "gemm": "GEMM formulation (in-graph): y = s*(x W0^T) + (x V) U^T, two matmuls per "
    "projection group",
    "precompute": "in-graph precompute: W_eff = s*W0 + U V^T formed in the graph on every "
    "forward, then one matmul",
    "custom-op": "custom op (in-graph): generated_linear / generated_mlp / generated_lowrank",
}


def _accelerator_api() -> str:
    from max.driver import accelerator_api  # ~0.4 s; only when the choice needs it

    return str(accelerator_api())


def serving_path(config: AttnquantConfig, accelerator_api: str | None = None) -> ServingPath:
    """The execution path (DESIGN §5) that ``config`` asks for.

    ``ATTNQUANT_PRECOMPUTE=1`` is in-graph precompute whatever
    ``ATTNQUANT_PRECOMPUTE_OUTSIDE`` says; ``ATTNQUANT_PRECOMPUTE_OUTSIDE=0``
    is an in-graph rebuild, GEMM or custom op as :func:`use_gemm_formulation`
    decides (``accelerator_api`` defaults to ``max.driver.accelerator_api()``,
    read only then).
    """
    if config.precompute:
        return "precompute"
    if config.precompute_outside:
        return "precompute-outside"
    if config.gemm is None and accelerator_api is None:
        accelerator_api = _accelerator_api()
    return "gemm" if use_gemm_formulation(config, accelerator_api or "cpu") else "custom-op"


def require_implemented(config: AttnquantConfig, accelerator_api: str | None = None) -> None:
    """Fail when ``config`` asks for an execution path this release does not serve.

    Every path is served (precompute-outside with or without NVFP4, the GEMM
    formulation, in-graph precompute, the custom op); NVFP4 on an in-graph path
    is not, and must stop the server at start-up rather than silently serve
    another. The custom op's rank limit is checked against the served rank by
    :func:`attnquant_max.plan_serving`.

    Raises
    ------
    NotImplementedError
        Naming the variable to change.
    """
    if config.quant is not None and serving_path(config, accelerator_api or "cpu") != (
        "precompute-outside"
    ):
        raise NotImplementedError(
            f"ATTNQUANT_QUANT={config.quant} quantizes each W_eff rebuilt once at load, so it "
            "needs the precompute-outside path: unset ATTNQUANT_PRECOMPUTE and "
            "ATTNQUANT_PRECOMPUTE_OUTSIDE (or set ATTNQUANT_PRECOMPUTE_OUTSIDE=1), or unset "
            "ATTNQUANT_QUANT to rebuild in the graph"
        )


def use_gemm_formulation(config: AttnquantConfig, accelerator_api: str) -> bool:
    """Choose the in-graph formulation: ``True`` for GEMM, ``False`` for the custom op.

    Parameters
    ----------
    config : AttnquantConfig
        An explicit ``ATTNQUANT_GEMM`` (``config.gemm``) always wins.
    accelerator_api : str
        ``max.driver.accelerator_api()``: ``"cuda"``, ``"hip"``, ``"metal"`` or
        ``"cpu"``.
    """
    if config.gemm is not None:
        return config.gemm
    api = accelerator_api.lower()
    if api in ("cuda", "hip"):
        # NVIDIA (and AMD): vendor-tuned GEMMs beat a straightforward rebuild kernel.
        return True
    if api == "metal":
        # Apple Metal: the custom op up to the rank it supports, GEMM above.
        return config.rank > CUSTOM_OP_MAX_RANK
    if api != "cpu":
        return True  # an accelerator nobody measured: the formulation that runs anywhere
    # CPU: the custom op up to its rank limit, GEMM above.
    # Measured on the reference machine (2 x86-64 cores, AVX2; 2026-11-30), one decoder
    # layer (hidden 1024, MLP 4096, float32), custom op / GEMM latency with 95% CI
    # (`python benchmarks/bench_kernels.py`):
    #   r=4:  batch 1 0.69 [0.57, 0.87]   batch 16 1.19 [1.11, 1.27]
    #   r=16: batch 1 0.43 [0.37, 0.53]   batch 16 0.91 [0.80, 1.02]
    #   r=64: batch 1 0.26 [0.19, 0.35]   batch 16 0.55 [0.50, 0.61]
    # Decode (batch 1) is where serving spends its steps, and the custom op is 1.5-3.8x
    # faster there at every rank; GEMM wins only at r=4 with 16-row batches, by 1.19x.
    return config.rank > CUSTOM_OP_MAX_RANK


# -- devices ------------------------------------------------------------------------------------

#: Architectures MAX 26.7 serves on a GPU only, with the encodings its model config accepts
#: (``SUPPORTED_ENCODINGS`` of ``max/pipelines/architectures/<arch>/model_config.py``). Every
#: one of them is a GPU-only pipeline encoding (``max/pipelines/modeling/config_enums.py``: on a
#: CPU MAX runs float32 and the GGUF q4_k/q4_0/q6_k only), so MAX refuses these models on a
#: CPU, with "quantization_encoding of 'float32' not supported by MAX engine".
GPU_ONLY_ARCHITECTURES: dict[str, tuple[str, ...]] = {
    "Gemma3ForCausalLM": ("bfloat16",),
    "Gemma3ForConditionalGeneration": ("bfloat16", "float8_e4m3fn"),
    "Gemma4ForConditionalGeneration": ("bfloat16", "float16", "float4_e2m1fnx2"),
    "Gemma4UnifiedForConditionalGeneration": ("bfloat16", "float16", "float4_e2m1fnx2"),
}


class DeviceError(ValueError):
    """The model cannot be served by MAX on the devices asked for (Gemma on a CPU)."""


def _architecture(model_path: str | os.PathLike[str]) -> str | None:
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
        return str((config.get("architectures") or [None])[0] or "") or None
    except (OSError, ValueError, AttributeError, TypeError):
        return None  # no readable config: MAX or the checkpoint reader says what is wrong


def require_device(
    model_path: str | os.PathLike[str],
    devices: str = "cpu",
    quantization_encoding: str | None = None,
) -> None:
    """Fail, saying why, when MAX 26.7 cannot serve ``model_path`` on ``devices``.

    Gemma 3 and Gemma 4 (:data:`GPU_ONLY_ARCHITECTURES`) run on a GPU only; asked for a CPU
    MAX stops with an encoding error that does not say so. Other architectures pass
    unchecked. Reads ``config.json`` only: nothing of MAX is imported.

    Raises
    ------
    DeviceError
        Naming the checkpoint, the architecture, why MAX needs a GPU for it, and what works.
    """
    arch = _architecture(model_path)
    if arch not in GPU_ONLY_ARCHITECTURES:
        return
    encodings = GPU_ONLY_ARCHITECTURES[arch]
    where = f"{model_path}: {arch}"
    if devices.strip().lower().startswith("cpu"):
        raise DeviceError(
            f"{where} needs a GPU in MAX 26.7: MAX serves it only in "
            f"{', '.join(encodings)}, encodings that MAX runs on GPUs only (on a CPU it runs "
            "float32, which MAX's Gemma models do not accept). Pass --devices gpu on a machine "
            "with a GPU. On this CPU, decompose, analyze and export work on Gemma checkpoints, "
            "and attnquant_core.gemma_reference computes Gemma 3 logits in numpy."
        )
    if quantization_encoding is not None and quantization_encoding not in encodings:
        raise DeviceError(
            f"{where}: MAX 26.7 serves it in {', '.join(encodings)} only, not "
            f"{quantization_encoding!r}; leave the encoding unset (MAX picks bfloat16)"
        )
