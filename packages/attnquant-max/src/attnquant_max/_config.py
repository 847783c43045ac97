"""Execution paths and devices: which formulation serves where, and what MAX cannot serve.

The options themselves are :class:`attnquant_max.ServingOptions` (:mod:`._options`); the plan of
a load (:func:`attnquant_max.plan_serving`) resolves ``--path auto`` against the checkpoint. Here:
the concrete path an explicit choice means on a device (:func:`serving_path`), the in-graph
formulation measured faster (:func:`use_gemm_formulation`), and the architectures MAX 26.7 runs on
a GPU only (:func:`require_device`).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Literal

from attnquant_core.serving import ServingOptions
from attnquant_kernels import MAX_RANK

__all__ = [
    "CPU_CRASHING_GRAPHS",
    "CUSTOM_OP_MAX_RANK",
    "PATH_DESCRIPTIONS",
    "DeviceError",
    "FULL_ATTENTION_ARCHITECTURES",
    "GPU_ONLY_ARCHITECTURES",
    "ServingPath",
    "require_device",
    "require_implemented",
    "serving_path",
    "use_gemm_formulation",
]

logger = logging.getLogger(__name__)

# Largest rank the custom op (`generated_linear`) accepts; above it the GEMM
# formulation is the only in-graph path. One number, attnquant-kernels' own.
CUSTOM_OP_MAX_RANK = MAX_RANK


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


def serving_path(
    options: ServingOptions, accelerator_api: str | None = None, *, compressed: bool = False
) -> ServingPath:
    """The execution path (docs/serving-paths.md) ``options`` ask for on a device.

    ``auto`` is the stock graph (precompute-outside) unless the checkpoint is ``compressed``
    (:func:`attnquant_max.plan_serving` decides that, and what else rules a path out), then an
    in-graph path like ``in-graph``: GEMM or the custom op as :func:`use_gemm_formulation`
    decides (``accelerator_api`` defaults to ``max.driver.accelerator_api()``, read only then).
    """
    path = options.path
    if path == "auto":
        path = "in-graph" if compressed else "precompute-outside"
    if path != "in-graph":
        return path  # type: ignore[return-value]
    if accelerator_api is None:
        accelerator_api = _accelerator_api()
    return "gemm" if use_gemm_formulation(options, accelerator_api) else "custom-op"


def require_implemented(options: ServingOptions) -> None:
    """Fail when ``options`` ask for a combination this release does not serve.

    ``--quant nvfp4`` quantizes each ``W_eff`` rebuilt once at load, so it needs the
    precompute-outside path (or ``auto``); asked with an in-graph path it stops the server at
    start-up rather than silently serving another. (A checkpoint whose ``W0`` is already NVFP4
    is served in the graph as stored: the plan handles it.)

    Raises
    ------
    NotImplementedError
        Naming the options to change.
    """
    if options.quant is not None and options.in_graph_asked:
        raise NotImplementedError(
            f"--quant {options.quant} (ATTNQUANT_QUANT) quantizes each W_eff rebuilt once at load, "
            f"so it needs the precompute-outside path, not --path {options.path}: pass --path "
            "precompute-outside or auto (ATTNQUANT_PATH), or drop --quant to serve in the graph"
        )


def use_gemm_formulation(options: ServingOptions, accelerator_api: str) -> bool:
    """Choose the in-graph formulation: ``True`` for GEMM, ``False`` for the custom op.

    ``--path gemm`` and ``--path custom-op`` always win; otherwise the device decides, and on a
    CPU or Apple Metal the correction's rank (``options.rank``; the plan passes a theta
    checkpoint's own).
    """
    if options.path == "gemm":
        return True
    if options.path == "custom-op":
        return False
    api = accelerator_api.lower()
    if api in ("cuda", "hip"):
        # NVIDIA (and AMD): vendor-tuned GEMMs beat a straightforward rebuild kernel.
        return True
    if api == "metal":
        # Apple Metal: the custom op up to the rank it supports, GEMM above.
        return options.rank > CUSTOM_OP_MAX_RANK
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
    return options.rank > CUSTOM_OP_MAX_RANK


# -- devices ------------------------------------------------------------------------------------

#: Architectures MAX 26.7 serves on a GPU only, with the encodings its model config accepts
#: (``SUPPORTED_ENCODINGS`` of ``max/pipelines/architectures/<arch>/model_config.py``). Every
#: one of them is a GPU-only pipeline encoding (``max/pipelines/modeling/config_enums.py``: on a
#: CPU MAX runs float32 and the GGUF q4_k/q4_0/q6_k only), so MAX refuses these models on a
#: CPU, with "quantization_encoding of 'float32' not supported by MAX engine".
GPU_ONLY_ARCHITECTURES: dict[str, tuple[str, ...]] = {
    "Gemma3ForConditionalGeneration": ("bfloat16", "float8_e4m3fn"),
    "Gemma4ForConditionalGeneration": ("bfloat16", "float16", "float4_e2m1fnx2"),
    "Gemma4UnifiedForConditionalGeneration": ("bfloat16", "float16", "float4_e2m1fnx2"),
}


#: Architectures whose MAX 26.7 graph cannot run on a CPU for a reason other than its encodings,
#: with that reason. Qwen3's pipeline model (``AlwaysSignalBuffersMixin``) allocates the
#: multi-device allreduce signal buffers even on one device, and on a CPU that allocation
#: crashes the process (a segmentation fault, seen in MAX 26.7).
CPU_CRASHING_GRAPHS: dict[str, str] = {
    "Qwen3ForCausalLM": (
        "MAX 26.7's Qwen3 graph allocates multi-device allreduce signal buffers even on one "
        "device, which crashes on a CPU"
    ),
}


#: The shortest sliding window MAX 26.7's fused CPU attention compiles for: its sliding mask
#: needs a window of at least the SIMD width it instantiates (128 seen on an AVX-512 machine;
#: windows 4 and 32 failed to compile, Gemma 3's 512 compiles: docs/gemma3-cpu.md).
MIN_CPU_SLIDING_WINDOW = 128


#: Architectures attnquant-max serves with full attention only, whose configs may ask for a
#: sliding window (Mistral 7B v0.1: 4096; Qwen2/3 where ``use_sliding_window`` is set). Up to
#: the window full attention is the same computation, so they are served up to it.
FULL_ATTENTION_ARCHITECTURES = ("MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def _full_attention_window(arch: str | None, config: dict[str, Any] | None) -> int | None:
    """The sliding window a full-attention architecture's config asks for (None: none)."""
    if arch not in FULL_ATTENTION_ARCHITECTURES or not config:
        return None
    if arch != "MistralForCausalLM" and not config.get("use_sliding_window"):
        return None
    try:
        window = int(config.get("sliding_window") or 0)
    except (TypeError, ValueError):
        return None
    return window or None


class DeviceError(ValueError):
    """The model cannot be served by MAX on the devices asked for (Gemma on a CPU)."""


def _read_config(model_path: str | os.PathLike[str]) -> dict[str, Any] | None:
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
        return config if isinstance(config, dict) else None
    except (OSError, ValueError):
        return None  # no readable config: MAX or the checkpoint reader says what is wrong


def _architecture_of(config: dict[str, Any] | None) -> str | None:
    try:
        return str(((config or {}).get("architectures") or [None])[0] or "") or None
    except (AttributeError, TypeError):
        return None


def _architecture(model_path: str | os.PathLike[str]) -> str | None:
    return _architecture_of(_read_config(model_path))


def _sliding_window(config: dict[str, Any] | None) -> int | None:
    """A Gemma config's ``sliding_window`` where it has sliding layers (else None)."""
    try:
        text = (config or {}).get("text_config", config) or {}
        layer_types = text.get("layer_types") or ["sliding_attention"]
        if "sliding_attention" not in layer_types:
            return None
        return int(text.get("sliding_window") or 0)
    except (AttributeError, TypeError, ValueError):
        return None


def require_device(
    model_path: str | os.PathLike[str],
    devices: str = "cpu",
    quantization_encoding: str | None = None,
    max_length: int | None = None,
) -> None:
    """Fail, saying why, when MAX 26.7 cannot serve ``model_path`` on ``devices``.

    Gemma 3 multimodal and Gemma 4 (:data:`GPU_ONLY_ARCHITECTURES`) run on a GPU only; asked
    for a CPU MAX stops with an encoding error that does not say so. Gemma 3 text runs on a CPU
    with a sliding window of at least :data:`MIN_CPU_SLIDING_WINDOW`. Qwen3's MAX graph crashes on
    a CPU (:data:`CPU_CRASHING_GRAPHS`): refused there. Mistral and Qwen configs
    that ask for a sliding window (:data:`FULL_ATTENTION_ARCHITECTURES`) are served with full
    attention, the same computation up to the window: ``max_length`` (else the config's
    ``max_position_embeddings``) past the window is refused. Other architectures pass
    unchecked. Reads ``config.json`` only: nothing of MAX is imported.

    Raises
    ------
    DeviceError
        Naming the checkpoint, the architecture, why MAX needs a GPU for it, and what works.
    """
    config = _read_config(model_path)
    arch = _architecture_of(config)
    on_cpu = devices.strip().lower().startswith("cpu")
    if arch == "Gemma3ForCausalLM" and on_cpu:
        window = _sliding_window(config)
        if window is not None and 0 < window < MIN_CPU_SLIDING_WINDOW:
            raise DeviceError(
                f"{model_path}: Gemma3ForCausalLM with sliding_window {window}: MAX 26.7's CPU "
                f"attention compiles its sliding mask for windows of {MIN_CPU_SLIDING_WINDOW} "
                "tokens or more (Gemma 3 releases use 512 and 1024); on this CPU the numpy "
                "forward (`attnquant eval --forward numpy`) scores it"
            )
    window = _full_attention_window(arch, config)
    length = max_length or int((config or {}).get("max_position_embeddings") or 0)
    if window is not None and length > window:
        raise DeviceError(
            f"{model_path}: {arch} with sliding_window {window}: attnquant serves it with full "
            f"attention, which is the same computation for sequences of up to {window} tokens "
            f"only; pass --max-length {window} or less (asked: {length})"
        )
    if arch in CPU_CRASHING_GRAPHS and on_cpu:
        raise DeviceError(
            f"{model_path}: {arch} needs a GPU here: {CPU_CRASHING_GRAPHS[arch]}. Pass "
            "--devices gpu on a machine with a GPU; on this CPU, decompose, calibrate and "
            "`attnquant eval --forward numpy` work on it"
        )
    if arch not in GPU_ONLY_ARCHITECTURES:
        return
    encodings = GPU_ONLY_ARCHITECTURES[arch]
    where = f"{model_path}: {arch}"
    if on_cpu:
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
