"""Writing a theta checkpoint: every tensor of every family under its key, then the manifest.

Writes go to a temporary directory that is renamed into place when complete.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import ml_dtypes
import numpy as np

from .._errors import (
    ThetaFormatError,
)
from ..forms._banded import FamilyTheta
from ..forms._factored import LowRankFamily, SharedBasisFamily
from ..forms._measure import FamilyErrors
from ..forms._model import FORMS, ThetaFamily, ThetaModel
from ._atomic import atomic_directory, copy_side_files
from ._checkpoint import (
    Checkpoint,
)
from ._manifest import (
    NVFP4_PARTS,
    basis_key,
    family_entry,
    nvfp4_key,
    shared_key,
    theta_key,
    theta_manifest,
    write_manifest,
)
from ._safetensors import (
    PlannedWriter,
    TensorSpec,
)

__all__ = [
    "copied_specs",
    "family_specs",
    "family_tensors",
    "nvfp4_specs",
    "plain_specs",
    "save_theta",
    "source_digest",
    "write_copied",
]


def family_specs(
    name: str,
    stack: str,
    *,
    form: str,
    shape: tuple[int, int],
    dtype: np.dtype,
    ranks: Sequence[int],
    bands: Sequence[int] | None,
    side: str | None = None,
    layers: Sequence[int] | None = None,
    family: str | None = None,
    quant: str | None = None,
) -> dict[str, tuple[TensorSpec, tuple[int, ...]]]:
    """Every tensor a family of ``form`` stores: key -> (spec, the layers that read it).

    ``quant="nvfp4"`` (banded only): each band's ``W0`` is the three NVFP4 tensors of
    :func:`nvfp4_specs` instead of one ``[out, in]`` tensor in ``dtype``.

    ``ranks`` and ``bands`` are per layer of the family; for a grouped family (see
    :class:`attnquant_core.io.FamilyInfo`) ``layers`` are the decoder layers it covers and
    ``family`` the projection named in its per-layer keys (``name`` names its shared keys).
    """
    out_dim, in_dim = shape
    L = len(ranks)
    specs: dict[str, tuple[TensorSpec, tuple[int, ...]]] = {}
    at = list(range(L)) if layers is None else list(layers)  # the family's decoder layers

    def key(layer: int, part: str) -> str:
        return theta_key(stack, at[layer], family or name, part)

    def locals_of(band: int) -> list[int]:
        return [i for i in range(L) if bands is not None and bands[i] == band]

    def members(band: int) -> tuple[int, ...]:
        return tuple(at[i] for i in locals_of(band))

    if form == "banded":
        assert bands is not None
        for b in range(max(bands) + 1):
            if quant is None:
                specs[shared_key(name, b)] = (TensorSpec(dtype, (out_dim, in_dim)), members(b))
            else:
                for key_b, spec in nvfp4_specs(name, b, shape).items():
                    specs[key_b] = (spec, members(b))
        for layer, r in enumerate(ranks):
            specs[key(layer, "s")] = (TensorSpec(dtype, (out_dim,)), (at[layer],))
            specs[key(layer, "U")] = (TensorSpec(dtype, (out_dim, r)), (at[layer],))
            specs[key(layer, "V")] = (TensorSpec(dtype, (in_dim, r)), (at[layer],))
    elif form == "lowrank":
        for layer, r in enumerate(ranks):
            specs[key(layer, "U")] = (TensorSpec(dtype, (out_dim, r)), (at[layer],))
            specs[key(layer, "V")] = (TensorSpec(dtype, (in_dim, r)), (at[layer],))
    elif form == "shared_basis":
        assert bands is not None
        basis_dim, coef_dim, part = (
            (in_dim, out_dim, "U") if side == "in" else (out_dim, in_dim, "V")
        )
        for b in range(max(bands) + 1):
            width = ranks[locals_of(b)[0]]
            specs[basis_key(name, b)] = (TensorSpec(dtype, (basis_dim, width)), members(b))
        for layer, k in enumerate(ranks):
            specs[key(layer, part)] = (TensorSpec(dtype, (coef_dim, k)), (at[layer],))
    else:
        raise ThetaFormatError(f"{name}: unknown form {form!r} (forms: {', '.join(FORMS)})")
    return specs


def nvfp4_specs(name: str, band: int, shape: tuple[int, int]) -> dict[str, TensorSpec]:
    """The keys and specs of one band's NVFP4 ``W0`` ``[out, in]`` (``in`` a multiple of 16)."""
    out_dim, in_dim = shape
    dtypes = (np.dtype(np.uint8), np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(np.float32))
    shapes = ((out_dim, in_dim // 2), (out_dim, in_dim // 16), ())
    return {
        nvfp4_key(name, band, part): TensorSpec(dt, sh)
        for part, dt, sh in zip(NVFP4_PARTS, dtypes, shapes, strict=True)
    }


def plain_specs(specs: Mapping[str, tuple[TensorSpec, tuple[int, ...]]]) -> dict[str, TensorSpec]:
    return {k: v[0] for k, v in specs.items()}


def family_tensors(
    stack: str, fam: ThetaFamily, name: str | None = None
) -> Iterator[tuple[str, np.ndarray]]:
    """Every stored tensor of an in-memory family, under its checkpoint key.

    ``name`` is the family's key in the checkpoint (default: ``fam.name``).
    """
    name = fam.name if name is None else name
    if isinstance(fam, FamilyTheta) and fam.nvfp4 is not None:
        for b, q in enumerate(fam.nvfp4):
            parts = (q.weight, q.weight_scale, q.weight_scale_2)
            for part, array in zip(NVFP4_PARTS, parts, strict=True):
                yield nvfp4_key(name, b, part), array
    elif isinstance(fam, FamilyTheta):
        for b, W0 in enumerate(fam.shared):
            yield shared_key(name, b), W0
    if isinstance(fam, FamilyTheta):
        for layer, t in enumerate(fam.layers):
            for part in ("s", "U", "V"):
                yield theta_key(stack, layer, name, part), getattr(t, part)
    elif isinstance(fam, LowRankFamily):
        for layer, (U, V) in enumerate(zip(fam.U, fam.V, strict=True)):
            yield theta_key(stack, layer, name, "U"), U
            yield theta_key(stack, layer, name, "V"), V
    elif isinstance(fam, SharedBasisFamily):
        for b, B in enumerate(fam.bases):
            yield basis_key(name, b), B
        part = "U" if fam.side == "in" else "V"
        for layer, C in enumerate(fam.coefs):
            yield theta_key(stack, layer, name, part), C
    else:  # pragma: no cover - ThetaModel refuses other types
        raise ThetaFormatError(f"{name}: {type(fam).__name__} is not a theta family")


def source_digest(array: np.ndarray) -> str:
    return "sha256:" + hashlib.sha256(np.ascontiguousarray(array).view(np.uint8).data).hexdigest()


def copied_specs(ckpt: Checkpoint) -> dict[str, TensorSpec]:
    """The tensors a theta checkpoint copies unchanged from ``ckpt``: all but the projections."""
    projection_keys = ckpt.projection_keys()
    return {k: ckpt.spec(k) for k in ckpt.keys() if k not in projection_keys}


def write_copied(
    writer: PlannedWriter, ckpt: Checkpoint, keys: Iterable[str], digests: dict[str, str]
) -> None:
    """Copy each of ``keys`` from ``ckpt`` (checked finite) to ``writer``, one tensor at a time,
    recording its source digest in ``digests``."""
    for key in keys:
        array = ckpt.get(key, check_finite=True)
        digests[key] = source_digest(array)
        writer.write(key, array)
        del array


def save_theta(
    model: ThetaModel,
    out: str | Path,
    *,
    config: Mapping | None = None,
    source_dir: str | Path | None = None,
    errors: Mapping[str, FamilyErrors] | None = None,
    notes: Mapping[str, Mapping[str, object]] | None = None,
    extra: Mapping[str, object] | None = None,
    overwrite: bool = False,
) -> dict:
    """Write an in-memory :class:`ThetaModel` (and its ``extra`` dense tensors) as a theta checkpoint.

    Families may be in any form (banded, low rank, shared basis) with per-layer ranks; each
    family is stored in one dtype. ``errors`` adds per-layer errors to a family's manifest
    entry, ``notes`` any other per-family fields, ``extra`` top-level manifest fields.
    """
    specs: dict[str, TensorSpec] = {
        k: TensorSpec(v.dtype, tuple(v.shape)) for k, v in model.extra.items()
    }
    families: dict[str, dict] = {}
    for name, fam in model.families.items():
        dtypes = {a.dtype for a in fam.arrays()}
        if len(dtypes) != 1:
            raise ThetaFormatError(
                f"{name}: a theta checkpoint stores one dtype per family; got dtypes "
                f"{sorted(map(str, dtypes))}"
            )
        dtype = dtypes.pop()
        specs.update(
            plain_specs(
                family_specs(
                    name,
                    model.stack,
                    form=fam.form,
                    shape=fam.shape,
                    dtype=dtype,
                    ranks=fam.ranks,
                    bands=fam.bands,
                    side=fam.side,
                    quant=getattr(fam, "quant", None),
                )
            )
        )
        errs = errors.get(name) if errors else None
        quant = getattr(fam, "quant", None)
        quantized = {} if quant is None else {"quant": quant, "stored_bytes": fam.stored_bytes()}
        families[name] = family_entry(
            form=fam.form,
            shape=fam.shape,
            dtype=dtype,
            source_dtype=dtype,
            ranks=fam.ranks,
            bands=fam.bands,
            side=fam.side,
            stored=fam.stored_parameters(),
            errors=errs.errors if errs else None,
            norms=errs.norms if errs else None,
            **quantized,
            **dict((notes or {}).get(name, {})),
        )
    with atomic_directory(Path(out), overwrite) as tmp:
        if source_dir is not None:
            copy_side_files(Path(source_dir), tmp)
        if config is not None:
            (tmp / "config.json").write_text(json.dumps(dict(config), indent=2) + "\n")
        with PlannedWriter(tmp, specs) as writer:
            for key, array in model.extra.items():
                writer.write(key, array)
            for name, fam in model.families.items():
                for key, array in family_tensors(model.stack, fam, name):
                    writer.write(key, array)
        manifest = theta_manifest(
            num_layers=model.num_layers,
            stack=model.stack,
            families=families,
            svd=None,
            source=None,
            **dict(extra or {}),
        )
        write_manifest(tmp, manifest)
    return manifest
