"""Export the rebuilt weights as a Model Optimizer (modelopt) NVFP4 checkpoint (numpy only).

For every decoder projection (``q/k/v/o/gate/up/down_proj`` of every layer) the output holds::

    <prefix>.weight          uint8          [out, in/2]   packed E2M1 codes
    <prefix>.weight_scale    float8_e4m3fn  [out, in/16]  one scale per 16 inputs
    <prefix>.weight_scale_2  float32        []            amax / (6 * 448)
    <prefix>.input_scale     float32        []            static activation scale (W4A4)

and every other tensor (embeddings, norms, ``lm_head``) unchanged, in its own dtype. This is the
layout modelopt's ``export_hf_checkpoint`` writes for ``quant_algo = "NVFP4"`` and the one MAX
26.7 declares for a modelopt NVFP4 ``Linear`` (``max/nn/linear.py``: ``weight`` uint8
``(out, in/2)``, ``weight_scale`` float8_e4m3fn ``(out, in/16)``, ``weight_scale_2`` and
``input_scale`` float32 of shape ``()``). The configuration is written twice, as modelopt does:
``hf_quant_config.json`` (``producer`` + ``quantization``) and a ``quantization_config`` block in
``config.json`` (``quant_method = "modelopt"``, ``ignore`` globs, ``config_groups``), which is
the one MAX reads first.

``input_scale``: modelopt calibrates it on sample activations (``amax / (6 * 448)``); MAX's
NVFP4 matmul divides the activation by it before computing 16-input E4M3 block scales and
multiplies it back in the epilogue, so it only sets which activation magnitudes those block
scales resolve well (about ``0.1 * input_scale`` to ``2688 * input_scale`` for a normal E4M3
scale). attnquant has no calibration data, so the default is 1.0, the value MAX's own offline
requantizer (``max/pipelines/weights/quantize_checkpoint.py``) writes for the same reason; pass
``input_scale=`` to use a calibrated value.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from .._version import __version__
from ..forms._nvfp4 import (
    BLOCK_SIZE,
    NVFP4Error,
    check_nvfp4_shape,
    dequantize_nvfp4,
    quantize_nvfp4,
)
from ._atomic import atomic_directory, copy_side_files
from ._checkpoint import Checkpoint, open_checkpoint
from ._manifest import is_theta_checkpoint
from ._safetensors import PlannedWriter, TensorSpec, dtype_from_name, dtype_name, is_float
from ._theta_read import ThetaCheckpoint

__all__ = [
    "HF_QUANT_CONFIG_FILE",
    "ExportProgress",
    "config_quantization",
    "export_nvfp4",
    "hf_quant_config",
    "nvfp4_specs",
]

logger = logging.getLogger(__name__)

HF_QUANT_CONFIG_FILE = "hf_quant_config.json"
# modelopt leaves the LM head unquantized by default and lists it among the excluded modules.
_ALWAYS_EXCLUDED = ("lm_head",)


@dataclass(frozen=True)
class ExportProgress:
    """One tensor written, reported to the ``progress`` callback of :func:`export_nvfp4`."""

    key: str
    done: int
    total: int
    quantized: bool
    max_abs_error: float | None


@dataclass(frozen=True)
class _Source:
    kind: str  # "theta" or "dense"
    path: Path
    specs: dict[str, TensorSpec]  # every dense key of the rebuilt model
    projections: frozenset[str]  # the `.weight` keys to quantize
    config: dict | None
    side_dir: Path | None
    state: Callable[[], Iterator[tuple[str, np.ndarray]]]


def _open_source(src: str | Path | Checkpoint | ThetaCheckpoint) -> _Source:
    """A theta checkpoint (rebuilt layer by layer) or a dense Hugging Face checkpoint."""
    if isinstance(src, ThetaCheckpoint) or (
        not isinstance(src, Checkpoint) and is_theta_checkpoint(src)
    ):
        theta = src if isinstance(src, ThetaCheckpoint) else ThetaCheckpoint.open(src)
        specs = {k: theta.tensors.spec(k) for k in theta.copied_keys()}
        projections = set()
        for name, fam in theta.families.items():
            dtype = _theta_dtype(fam)
            projection = theta.projection_of(name)  # grouped families: the layers' projection
            for layer in theta.layers_of(name):
                key = f"{theta.stack}.{layer}.{projection}.weight"
                specs[key] = TensorSpec(dtype, tuple(fam["shape"]))
                projections.add(key)
        return _Source(
            "theta",
            theta.path,
            specs,
            frozenset(projections),
            theta.config,
            theta.path,
            theta.rebuilt_state,
        )
    ckpt = src if isinstance(src, Checkpoint) else open_checkpoint(src)
    projections = frozenset(ckpt.projection_keys())

    def state() -> Iterator[tuple[str, np.ndarray]]:
        for key in ckpt.keys():  # quantize_nvfp4 refuses NaN/Inf projections, naming the key
            yield key, ckpt.get(key)

    return _Source(
        "dense",
        ckpt.path,
        {k: ckpt.spec(k) for k in ckpt.keys()},
        projections,
        ckpt.config,
        ckpt.directory if ckpt.path.is_dir() else None,
        state,
    )


def _theta_dtype(fam: dict) -> np.dtype:
    return dtype_from_name(fam.get("source_dtype", fam["dtype"]))


def nvfp4_specs(prefix: str, shape: tuple[int, int]) -> dict[str, TensorSpec]:
    """Keys, dtypes and shapes of one NVFP4 projection ``prefix`` of dense shape ``(out, in)``."""
    check_nvfp4_shape(shape, name=f"{prefix}.weight")
    out_dim, in_dim = shape
    return {
        f"{prefix}.weight": TensorSpec(np.dtype(np.uint8), (out_dim, in_dim // 2)),
        f"{prefix}.weight_scale": TensorSpec(
            np.dtype(ml_dtypes.float8_e4m3fn), (out_dim, in_dim // BLOCK_SIZE)
        ),
        f"{prefix}.weight_scale_2": TensorSpec(np.dtype(np.float32), ()),
        f"{prefix}.input_scale": TensorSpec(np.dtype(np.float32), ()),
    }


def _excluded_modules(source: _Source) -> list[str]:
    """Linear layers left in full precision: ``lm_head`` and any other copied 2-D weight.

    Embeddings are not ``Linear`` modules, so modelopt does not list them; norms are 1-D.
    """
    excluded = set(_ALWAYS_EXCLUDED)
    for key, spec in source.specs.items():
        if (
            key not in source.projections
            and key.endswith(".weight")
            and len(spec.shape) == 2
            and is_float(spec.dtype)
            and "embed" not in key
        ):
            excluded.add(key.removesuffix(".weight"))
    return sorted(excluded)


def _producer() -> dict[str, str]:
    writer = f"attnquant-core {__version__}"
    # MAX maps `producer.name` to `quant_method`, so it must read "modelopt"; the version says
    # who wrote the file.
    return {"name": "modelopt", "version": writer}


def hf_quant_config(exclude_modules: list[str]) -> dict:
    """``hf_quant_config.json`` as modelopt writes it for NVFP4."""
    return {
        "producer": _producer(),
        "quantization": {
            "quant_algo": "NVFP4",
            "kv_cache_quant_algo": None,
            "group_size": BLOCK_SIZE,
            "exclude_modules": list(exclude_modules),
        },
    }


def config_quantization(exclude_modules: list[str]) -> dict:
    """The ``quantization_config`` block of ``config.json`` (modelopt's converted form)."""
    fp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": BLOCK_SIZE}
    return {
        "config_groups": {
            "group_0": {
                "input_activations": dict(fp4),
                "weights": dict(fp4),
                "targets": ["Linear"],
            }
        },
        "ignore": list(exclude_modules),
        "quant_algo": "NVFP4",
        "producer": _producer(),
        "quant_method": "modelopt",
    }


def export_nvfp4(
    src: str | Path | Checkpoint | ThetaCheckpoint,
    out: str | Path,
    *,
    input_scale: float = 1.0,
    overwrite: bool = False,
    max_shard_bytes: int = 2 << 30,
    progress: Callable[[ExportProgress], None] | None = None,
) -> dict:
    """Write ``src``'s rebuilt weights to ``out`` as a modelopt NVFP4 checkpoint.

    Parameters
    ----------
    src : path, Checkpoint or ThetaCheckpoint
        A theta checkpoint (each projection rebuilt, ``W_eff = diag(s) W0 + U V^T``, then
        quantized) or a dense Hugging Face checkpoint (its projections quantized as they are).
    out : path
        Output directory. Written to a temporary sibling and renamed when complete.
    input_scale : float, default=1.0
        The static per-tensor activation scale written for every projection (see the module
        docstring: no calibration data, so 1.0 as MAX's requantizer writes).
    overwrite : bool, default=False
        Replace ``out`` if it exists.
    max_shard_bytes : int, default=2 GiB
        Largest safetensors shard.
    progress : callable, optional
        Called with an :class:`ExportProgress` after each tensor is written.

    Returns
    -------
    summary : dict
        ``quantized`` / ``copied`` tensor counts; ``packed_bytes`` (the NVFP4 tensors, scales
        included), ``float32_bytes`` and ``source_bytes`` of the same projections;
        ``max_abs_error`` and ``max_rel_error`` (Frobenius) over projections; ``tensors``: per
        projection ``shape``, ``max_abs_error``, ``rel_error``; ``exclude_modules``;
        ``input_scale``.

    Raises
    ------
    NVFP4Error
        Before anything is written, for a projection whose inner dimension is not a multiple
        of 16; while writing, for NaN/Inf weights. Nothing is left at ``out`` on failure.
    """
    if not (np.isfinite(input_scale) and input_scale > 0):
        raise NVFP4Error(f"input_scale must be a positive finite float, got {input_scale!r}")
    source = _open_source(src)
    out = Path(out)
    if out.resolve() == source.path.resolve():
        raise ValueError(f"{out}: the export would overwrite its own source; choose another -o")

    specs: dict[str, TensorSpec] = {}
    for key, spec in source.specs.items():
        if key in source.projections:
            if not is_float(spec.dtype):
                raise NVFP4Error(f"{source.path}: {key} has dtype {spec.dtype}, expected a float")
            try:
                specs.update(nvfp4_specs(key.removesuffix(".weight"), spec.shape))
            except NVFP4Error as exc:
                raise NVFP4Error(f"{source.path}: {exc}") from None
        else:
            specs[key] = spec
    excluded = _excluded_modules(source)
    scale_in = np.asarray(input_scale, np.float32).reshape(())

    tensors: dict[str, dict] = {}
    packed_bytes = float32_bytes = source_bytes = 0
    total = len(source.specs)
    with atomic_directory(out, overwrite) as tmp:
        copy_side_files(source.side_dir, tmp)
        with PlannedWriter(tmp, specs, max_shard_bytes=max_shard_bytes) as writer:
            for done, (key, array) in enumerate(source.state(), start=1):
                if key not in source.projections:
                    writer.write(key, array)
                    del array
                    if progress is not None:
                        progress(ExportProgress(key, done, total, False, None))
                    continue
                prefix = key.removesuffix(".weight")
                try:
                    q = quantize_nvfp4(array, name=key)
                except NVFP4Error as exc:
                    raise NVFP4Error(f"{source.path}: {exc}") from None
                for name, value in q.tensors(prefix).items():
                    writer.write(name, value)
                writer.write(f"{prefix}.input_scale", scale_in)
                W = array.astype(np.float32)
                del array
                diff = W - dequantize_nvfp4(q)
                norm = float(np.linalg.norm(W))
                stats = {
                    "shape": list(W.shape),
                    "max_abs_error": float(np.max(np.abs(diff))) if diff.size else 0.0,
                    "rel_error": float(np.linalg.norm(diff)) / norm if norm > 0 else 0.0,
                }
                del diff
                tensors[key] = stats
                packed_bytes += q.nbytes + scale_in.nbytes
                float32_bytes += W.size * 4
                source_bytes += W.size * source.specs[key].dtype.itemsize
                del W, q
                logger.debug("%s: NVFP4, max abs error %.3g", key, stats["max_abs_error"])
                if progress is not None:
                    progress(ExportProgress(key, done, total, True, stats["max_abs_error"]))
        config = dict(source.config or {})
        config["quantization_config"] = config_quantization(excluded)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / HF_QUANT_CONFIG_FILE).write_text(
            json.dumps(hf_quant_config(excluded), indent=2) + "\n"
        )
    summary = {
        "format": "nvfp4",
        "source": str(source.path),
        "source_kind": source.kind,
        "output": str(out),
        "quantized": len(tensors),
        "copied": total - len(tensors),
        "packed_bytes": packed_bytes,
        "float32_bytes": float32_bytes,
        "source_bytes": source_bytes,
        "source_dtypes": sorted({dtype_name(source.specs[k].dtype) for k in tensors}),
        "max_abs_error": max((t["max_abs_error"] for t in tensors.values()), default=0.0),
        "max_rel_error": max((t["rel_error"] for t in tensors.values()), default=0.0),
        "input_scale": float(scale_in),
        "exclude_modules": excluded,
        "tensors": tensors,
    }
    logger.info(
        "exported %d projections to NVFP4 (%d bytes, float32 %d bytes) and copied %d tensors to %s",
        summary["quantized"],
        packed_bytes,
        float32_bytes,
        summary["copied"],
        out,
    )
    return summary
