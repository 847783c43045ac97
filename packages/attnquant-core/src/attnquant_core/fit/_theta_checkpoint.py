"""Decomposing a whole checkpoint into a theta checkpoint, streamed layer by layer."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from ..forms._bands import band_of_layers, band_sizes, group_blocks, resolve_blocks
from ..forms._identity import compute_dtype
from ..io._atomic import atomic_directory, copy_side_files
from ..io._calibration import CalibrationStats
from ..io._checkpoint import (
    Checkpoint,
    FamilyInfo,
    open_checkpoint,
)
from ..io._manifest import (
    NVFP4_PARTS,
    family_entry,
    nvfp4_bytes,
    nvfp4_key,
    shared_key,
    stored_of,
    theta_key,
    theta_manifest,
    write_manifest,
)
from ..io._safetensors import (
    PlannedWriter,
    TensorSpec,
)
from ..io._theta_write import (
    copied_specs,
    family_specs,
    plain_specs,
    source_digest,
    write_copied,
)
from ._align_transforms import aligned_record
from ._budget import decompose_budget
from ._decompose import (
    DEFAULT_SVD,
    DecomposeProgress,
    SVDOptions,
    check_quant,
    check_rank,
    decompose_family,
    fit_layer,
    quantized_band,
)
from ._gptq import band_gram, rounding_fields
from ._spec import DEFAULT_BLOCKS, DEFAULT_ROUNDING, DecomposeSpec, spec_from
from ._whitened import Calibration, as_calibration, fit_layer_whitened

__all__ = ["decompose_checkpoint", "rebuild_dense_state"]


def decompose_checkpoint(
    src: str | Path | Checkpoint,
    out: str | Path,
    *,
    blocks: int | str | None = None,
    rank: int | None = None,
    budget: float | None = None,
    dtype: np.dtype | type | None = None,
    svd: SVDOptions = DEFAULT_SVD,
    progress: Callable[[DecomposeProgress], None] | None = None,
    max_shard_bytes: int = 2 << 30,
    overwrite: bool = False,
    aligned_from: str | Path | None = None,
    calibration: str | Path | CalibrationStats | Calibration | None = None,
    quant: str | None = None,
    rounding: str = DEFAULT_ROUNDING,
    spec: DecomposeSpec | None = None,
) -> dict:
    """Decompose every projection family of a checkpoint into a theta checkpoint at ``out``.

    With ``blocks`` (default 1, :data:`~attnquant_core.fit.DEFAULT_BLOCKS`, with ``quant=``
    too) and ``rank`` (default :data:`~attnquant_core.fit.DEFAULT_RANK`): every family banded,
    ``G`` bands, rank ``r``. With ``budget`` (stored / dense parameters, in ``(0, 1]``)
    instead: the form and the ranks of each family and layer are chosen to minimise the total
    squared error at that size (:func:`attnquant_core.decompose_budget`); ``budget`` excludes
    ``blocks`` and ``rank``.

    Streams: each band's ``W0`` is accumulated one layer at a time, then each layer is read
    again for ``s``, the residual and its SVD, and written in place; peak memory follows the
    largest single weight, not the number of layers. ``dtype`` is the storage dtype (default:
    each family's source dtype). Returns the ``attnquant.json`` manifest. Nothing is left at
    ``out`` if anything fails.

    ``aligned_from``: ``src`` is an aligned copy of that checkpoint (written by
    :func:`attnquant_core.align_checkpoint`); the manifest then names it as the source and
    records the alignment under ``"aligned"`` (the transforms come along with the side files).

    ``calibration``: a statistics file (:mod:`attnquant_core.calib`) or opened statistics;
    each layer's ``s`` and residual SVD then minimise the output error over the calibration
    inputs (whitened least squares and SVD-LLM's whitened SVD), a projection without
    statistics is fit unwhitened, and the manifest records the statistics under
    ``"calibration"`` and each family's relative output errors under ``"output_errors"``.

    ``quant="nvfp4"``: each band's ``W0`` (the band mean; ``W`` itself at passthrough) is stored
    in NVFP4 (format version 4) and ``s``, ``U``, ``V`` are fitted against its dequantization:
    ``W ~ diag(s) Q(W0) + U V^T``, the low-rank part correcting the quantization error (whitened
    with ``calibration``). With ``budget``, a banded family *may* take an NVFP4 ``W0`` where it
    lowers the total error, and the budget counts stored bytes over dense bytes for every form
    (:func:`attnquant_core.decompose_budget`). ``rounding``: how an NVFP4 ``W0`` is rounded
    where statistics cover its band: ``"gptq"`` (default; GPTQ's error-compensated rounding for
    the band's input gram, :func:`~attnquant_core.fit._gptq.gptq_nvfp4`, recorded as the
    family's ``"rounding"``) or ``"nearest"`` (modelopt's round to nearest, as without
    statistics).

    ``spec``: these options as one :class:`~attnquant_core.DecomposeSpec` (validated when
    made; its ``blocks`` default is passthrough with ``quant``), instead of ``blocks=`` ...
    ``rounding=``. Its ``align`` and ``calibration_data`` are its callers' to act on
    (:func:`~attnquant_core.align_checkpoint`, :func:`~attnquant_core.calib.decompose_calibrated`).
    """
    if spec is None and blocks is None and budget is None:
        blocks = DEFAULT_BLOCKS  # the keyword API's band mean, with quant= too
    spec = spec_from(
        spec,
        blocks=blocks,
        rank=rank,
        budget=budget,
        calibration=calibration,
        quant=quant,
        rounding=rounding,
    )
    if spec.budget is not None:
        report = decompose_budget(
            src,
            out,
            spec=spec,
            dtype=dtype,
            svd=svd,
            progress=progress,
            max_shard_bytes=max_shard_bytes,
            overwrite=overwrite,
            aligned_from=aligned_from,
        )
        assert report.manifest is not None
        return report.manifest
    cal = as_calibration(spec.calibration)
    blocks, rank = spec.effective_blocks, spec.effective_rank
    quant, rounding = spec.quant, spec.rounding
    ckpt = src if isinstance(src, Checkpoint) else open_checkpoint(src)
    aligned = None if aligned_from is None else aligned_record(ckpt)
    G = resolve_blocks(blocks, ckpt.num_layers)
    copied = copied_specs(ckpt)

    specs: dict[str, TensorSpec] = dict(copied)
    store: dict[str, np.dtype] = {}
    for name, info in ckpt.families.items():
        check_rank(name, info.shape, rank)
        check_quant(name, info.shape, quant)
    for name, info in ckpt.families.items():
        store[name] = np.dtype(dtype) if dtype is not None else info.dtype
        specs.update(
            plain_specs(
                family_specs(
                    name,
                    info.stack,
                    form="banded",
                    shape=info.shape,
                    dtype=store[name],
                    ranks=[rank] * info.num_layers,
                    bands=band_of_layers(info.num_layers, _family_blocks(info, G, ckpt)),
                    layers=info.layers,
                    family=info.family,
                    quant=quant,
                )
            )
        )

    digests: dict[str, str] = {}
    families: dict[str, dict] = {}
    with atomic_directory(Path(out), overwrite) as tmp:
        copy_side_files(ckpt.directory if ckpt.path.is_dir() else None, tmp)
        with PlannedWriter(tmp, specs, max_shard_bytes=max_shard_bytes) as writer:
            write_copied(writer, ckpt, copied, digests)
            for name, info in ckpt.families.items():
                L = info.num_layers  # the family's layers (its group's, when grouped)
                G_family = _family_blocks(info, G, ckpt)
                bands = band_of_layers(L, G_family)
                errors: list[float] = []
                norms: list[float] = []
                out_errors: list[float | None] = []
                white = None if cal is None else cal.getter(info.keys, info.shape[1])
                gptq_bands = 0
                start = 0
                for b, size in enumerate(band_sizes(L, G_family)):
                    layers = range(start, start + size)
                    held: np.ndarray | None = None
                    cdt = compute_dtype(np.result_type(info.dtype, store[name]))
                    acc = np.zeros(info.shape, cdt)
                    for layer in layers:  # pass 1: the band mean, one layer at a time
                        W = ckpt.get(info.keys[layer], check_finite=True)
                        digests[info.keys[layer]] = source_digest(W)
                        acc += W
                        held = W if size == 1 else None
                        del W
                    acc /= size
                    if quant is None:
                        W0 = acc.astype(store[name])
                        writer.write(shared_key(name, b), W0)
                    else:
                        gram = band_gram(white, layers) if rounding == "gptq" else None
                        gptq_bands += gram is not None
                        q, W0 = quantized_band(acc.astype(np.float32), f"{name} band {b}", gram)
                        del gram
                        parts = (q.weight, q.weight_scale, q.weight_scale_2)
                        for part, array in zip(NVFP4_PARTS, parts, strict=True):
                            writer.write(nvfp4_key(name, b, part), array)
                        del q
                    del acc
                    for layer in layers:  # pass 2: s, residual, SVD, one layer at a time
                        W = held if held is not None else ckpt.get(info.keys[layer])
                        w = None if white is None else white(layer)
                        if w is None:
                            fit = fit_layer(
                                W, W0, rank, dtype=store[name], svd=svd, seed=(b, layer)
                            )
                            out_errors.append(None)
                        else:
                            fit, out_error = fit_layer_whitened(
                                W, W0, rank, w, dtype=store[name], svd=svd, seed=(b, layer)
                            )
                            out_errors.append(out_error)
                        # Drop this layer's factor (8 n^2 bytes) before the next one is made.
                        del W, w
                        for part in ("s", "U", "V"):
                            writer.write(
                                theta_key(info.stack, info.layers[layer], info.family, part),
                                getattr(fit.theta, part),
                            )
                        errors.append(fit.error)
                        norms.append(fit.norm)
                        if progress is not None:
                            progress(DecomposeProgress(name, layer, L, fit.error))
                    held = None
                    start += size
                families[name] = family_entry(
                    form="banded",
                    shape=info.shape,
                    dtype=store[name],
                    source_dtype=info.dtype,
                    ranks=[rank] * L,
                    bands=bands,
                    stored=stored_of("banded", info.shape, [rank] * L, bands),
                    errors=errors,
                    norms=norms,
                    **({} if cal is None else {"output_errors": out_errors}),
                    **_quant_fields(quant, info.shape, [rank] * L, bands, store[name]),
                    **rounding_fields(gptq_bands, max(bands) + 1),
                    **_group_fields(info, model_blocks=G),
                )
        manifest = theta_manifest(
            num_layers=ckpt.num_layers,
            stack=ckpt.stack,
            families=families,
            svd=svd.to_json(),
            source={"path": str(aligned_from or ckpt.path), "digests": digests},
            aligned=aligned,
            **({} if cal is None else {"calibration": cal.record(sorted(ckpt.projection_keys()))}),
        )
        write_manifest(tmp, manifest)
    return manifest


def _family_blocks(info: FamilyInfo, blocks: int, ckpt: Checkpoint) -> int:
    """A family's bands at the model-wide ``G``: ``G`` itself, or its group's share of it."""
    if info.group is None:
        return blocks
    return group_blocks(blocks, info.num_layers, ckpt.num_layers)


def _quant_fields(
    quant: str | None,
    shape: tuple[int, int],
    ranks: list[int],
    bands: list[int],
    dtype: np.dtype,
) -> dict[str, object]:
    """A quantized family's manifest fields (format version 4): ``quant``, ``stored_bytes``."""
    if quant is None:
        return {}
    out_dim, in_dim = shape
    per_layer = sum(out_dim + r * (out_dim + in_dim) for r in ranks) * np.dtype(dtype).itemsize
    return {"quant": quant, "stored_bytes": (max(bands) + 1) * nvfp4_bytes(shape) + per_layer}


def _group_fields(info: FamilyInfo, **extra: object) -> dict[str, object]:
    """The manifest fields of a grouped family (format version 3); none for a uniform one."""
    if info.group is None:
        return {}
    return {"family": info.family, "group": info.group, "layers": list(info.layers), **extra}


def rebuild_dense_state(
    ckpt: Checkpoint | str | Path,
    *,
    blocks: int | str = "layers",
    rank: int = 16,
    svd: SVDOptions = DEFAULT_SVD,
) -> Iterator[tuple[str, np.ndarray]]:
    """Decompose a dense checkpoint in memory, family by family, and yield the rebuilt state.

    The same contract as :meth:`ThetaCheckpoint.rebuilt_state`: every dense key, projections
    replaced by ``W_eff`` in their source dtype. Holds one family at a time.
    """
    ckpt = ckpt if isinstance(ckpt, Checkpoint) else open_checkpoint(ckpt)
    projection_keys = ckpt.projection_keys()
    for key in ckpt.keys():
        if key not in projection_keys:
            yield key, ckpt.get(key)
    G = resolve_blocks(blocks, ckpt.num_layers)
    for name, info in ckpt.families.items():
        weights = [ckpt.get(k, check_finite=True) for k in info.keys]
        theta, _ = decompose_family(
            weights, blocks=_family_blocks(info, G, ckpt), rank=rank, name=name, svd=svd
        )
        del weights
        for layer, key in enumerate(info.keys):
            yield key, theta.reconstruct(layer).astype(info.dtype)
