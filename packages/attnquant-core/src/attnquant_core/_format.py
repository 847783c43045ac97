"""The theta checkpoint (DESIGN §4): a Hugging Face directory plus theta keys and ``attnquant.json``.

Writes go to a temporary directory that is renamed into place when complete; reads are lazy
(headers at open, tensors on demand) and validate every theta key against its band's ``W0``.

Format version 2 (written now) names the form of every family in ``attnquant.json``
(``"banded"``, ``"lowrank"``, ``"shared_basis"`` with its ``"side"``), the band of every layer
(``null`` for low rank) and the rank of every layer (``"ranks"``; ``"rank"`` is their maximum).
Keys per form, ``<layer>`` being ``<stack>.<l>.<family>``:

* banded: ``<layer>.theta_s [out]``, ``<layer>.theta_U [out, r_l]``, ``<layer>.theta_V
  [in, r_l]``, ``attnquant.shared.<family>.<band>.W0 [out, in]``;
* lowrank: ``<layer>.theta_U [out, r_l]``, ``<layer>.theta_V [in, r_l]``;
* shared_basis, side in: ``attnquant.shared.<family>.<band>.basis [in, k_b]``,
  ``<layer>.theta_U [out, k_b]``; side out: ``...basis [out, k_b]``, ``<layer>.theta_V [in, k_b]``.

Version 1 checkpoints (every family banded, one rank) are still read.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from ._bands import band_of_layers, band_sizes, resolve_blocks
from ._checkpoint import (
    FAMILIES,
    INDEX_FILE,
    Checkpoint,
    check_config_dims,
    embedding_spec,
    open_checkpoint,
    read_tensor_directory,
)
from ._decompose import (
    FamilyErrors,
    SVDOptions,
    check_rank,
    decompose_family,
    fit_layer,
    pooled_error,
)
from ._errors import (
    AttnquantError,
    BandMismatchError,
    DecompositionError,
    OutputBusyError,
    OutputError,
    ThetaFormatError,
)
from ._forms import SIDES, LowRankFamily, SharedBasisFamily
from ._safetensors_io import (
    DIGESTS_FILE,
    PlannedWriter,
    SafetensorsFiles,
    TensorSpec,
    dtype_from_name,
    dtype_name,
)
from ._svd import compute_dtype
from ._theta import FORMS, FamilyTheta, LayerTheta, ThetaFamily, ThetaModel, reconstruct

__all__ = [
    "FORMAT_NAME",
    "family_entry",
    "family_specs",
    "family_tensors",
    "stored_of",
    "atomic_directory",
    "copy_side_files",
    "FORMAT_VERSION",
    "MANIFEST_FILE",
    "DecomposeProgress",
    "ThetaCheckpoint",
    "basis_key",
    "decompose_checkpoint",
    "is_theta_checkpoint",
    "rebuild_dense_state",
    "save_theta",
    "shared_key",
    "theta_key",
]

FORMAT_NAME = "attnquant-theta"
FORMAT_VERSION = 2
MANIFEST_FILE = "attnquant.json"
BLOCKS_HINT = "this almost always means ATTNQUANT_BLOCKS differs between decomposition and serving"


def theta_key(stack: str, layer: int, family: str, part: str) -> str:
    """``model.layers.3.self_attn.q_proj.theta_U`` for ``part`` in ``s``, ``U``, ``V``."""
    return f"{stack}.{layer}.{family}.theta_{part}"


def shared_key(family: str, band: int) -> str:
    """``attnquant.shared.self_attn.q_proj.0.W0``."""
    return f"attnquant.shared.{family}.{band}.W0"


def basis_key(family: str, band: int) -> str:
    """``attnquant.shared.self_attn.q_proj.0.basis`` (shared-basis form)."""
    return f"attnquant.shared.{family}.{band}.basis"


def dense_key(stack: str, layer: int, family: str) -> str:
    return f"{stack}.{layer}.{family}.weight"


def is_theta_checkpoint(path: str | Path) -> bool:
    """True when ``path`` is a directory holding an ``attnquant.json``."""
    return (Path(path) / MANIFEST_FILE).is_file()


@dataclass(frozen=True)
class DecomposeProgress:
    """One layer done, reported to the ``progress`` callback of :func:`decompose_checkpoint`.

    ``stage`` is ``"fit"`` when the layer's tensors were fitted (``error`` is its relative
    error), ``"spectra"`` when a budget decomposition measured its spectra (``error`` is NaN).
    """

    family: str
    layer: int
    num_layers: int
    error: float
    stage: str = "fit"


# -- writing -------------------------------------------------------------------------------


@contextlib.contextmanager
def atomic_directory(out: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of ``out``; rename it to ``out`` only if the block succeeds.

    Survives faults: a failed block (a full disk included) removes the temporary directory and
    raises :class:`OutputError`; a killed run leaves only its temporary directory, which the next
    run writing ``out`` removes. Two runs writing ``out`` at once cannot both proceed: a lock
    (``.<name>.lock``, ``flock``, released by the kernel however its holder dies) makes the
    second fail at once with :class:`OutputBusyError`. ``out`` is checked again under the lock,
    so a run never replaces what another finished meanwhile unless ``overwrite``.
    """
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; remove it or pass overwrite=True")
    out.parent.mkdir(parents=True, exist_ok=True)
    with _output_lock(out):
        for kind in ("tmp", "old"):  # left by a killed run: no live run holds them now
            for stale in out.parent.glob(f".{glob.escape(out.name)}.{kind}-*"):
                shutil.rmtree(stale, ignore_errors=True)
        if out.exists() and not overwrite:
            raise FileExistsError(f"{out} already exists; remove it or pass overwrite=True")
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            try:
                yield tmp
            except OSError as exc:
                if isinstance(exc, AttnquantError | FileExistsError | FileNotFoundError):
                    raise
                raise OutputError(f"{out}: not written, nothing left behind ({exc})") from exc
            if out.exists():
                if not overwrite:
                    raise FileExistsError(f"{out} already exists; remove it or pass overwrite=True")
                old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
                os.replace(out, old / out.name)
                os.replace(tmp, out)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, out)
            _fsync_directory(out.parent)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _output_lock(out: Path) -> Iterator[None]:
    """Hold ``.<out name>.lock`` beside ``out`` exclusively, or raise :class:`OutputBusyError`."""
    import fcntl

    lock = out.parent / f".{out.name}.lock"
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutputBusyError(
                f"{out}: another attnquant run is writing it now (lock {lock.name}); wait for "
                f"it to finish or write elsewhere"
            ) from None
        try:  # the file we locked may have been unlinked by its previous holder: lock anew
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            lock.unlink()
        os.close(fd)


def _fsync_directory(directory: Path) -> None:
    """Make a rename inside ``directory`` durable (no-op where directories cannot be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def copy_side_files(src_dir: Path | None, dst: Path) -> None:
    """Copy config, tokenizer and other non-tensor files of a checkpoint directory into ``dst``."""
    if src_dir is None or not src_dir.is_dir():
        return
    for item in sorted(src_dir.iterdir()):
        if (
            item.is_file()
            and item.suffix != ".safetensors"
            and item.name not in {INDEX_FILE, MANIFEST_FILE, DIGESTS_FILE}
            and not item.name.startswith(".")
        ):
            shutil.copy2(item, dst / item.name)


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
) -> dict[str, tuple[TensorSpec, tuple[int, ...]]]:
    """Every tensor a family of ``form`` stores: key -> (spec, the layers that read it)."""
    out_dim, in_dim = shape
    L = len(ranks)
    specs: dict[str, tuple[TensorSpec, tuple[int, ...]]] = {}

    def members(band: int) -> tuple[int, ...]:
        return tuple(i for i in range(L) if bands is not None and bands[i] == band)

    if form == "banded":
        assert bands is not None
        for b in range(max(bands) + 1):
            specs[shared_key(name, b)] = (TensorSpec(dtype, (out_dim, in_dim)), members(b))
        for layer, r in enumerate(ranks):
            specs[theta_key(stack, layer, name, "s")] = (TensorSpec(dtype, (out_dim,)), (layer,))
            specs[theta_key(stack, layer, name, "U")] = (TensorSpec(dtype, (out_dim, r)), (layer,))
            specs[theta_key(stack, layer, name, "V")] = (TensorSpec(dtype, (in_dim, r)), (layer,))
    elif form == "lowrank":
        for layer, r in enumerate(ranks):
            specs[theta_key(stack, layer, name, "U")] = (TensorSpec(dtype, (out_dim, r)), (layer,))
            specs[theta_key(stack, layer, name, "V")] = (TensorSpec(dtype, (in_dim, r)), (layer,))
    elif form == "shared_basis":
        assert bands is not None
        basis_dim, coef_dim, part = (
            (in_dim, out_dim, "U") if side == "in" else (out_dim, in_dim, "V")
        )
        for b in range(max(bands) + 1):
            layers = members(b)
            specs[basis_key(name, b)] = (TensorSpec(dtype, (basis_dim, ranks[layers[0]])), layers)
        for layer, k in enumerate(ranks):
            specs[theta_key(stack, layer, name, part)] = (
                TensorSpec(dtype, (coef_dim, k)),
                (layer,),
            )
    else:
        raise ThetaFormatError(f"{name}: unknown form {form!r} (forms: {', '.join(FORMS)})")
    return specs


def _plain_specs(specs: Mapping[str, tuple[TensorSpec, tuple[int, ...]]]) -> dict[str, TensorSpec]:
    return {k: v[0] for k, v in specs.items()}


def family_tensors(
    stack: str, fam: ThetaFamily, name: str | None = None
) -> Iterator[tuple[str, np.ndarray]]:
    """Every stored tensor of an in-memory family, under its checkpoint key.

    ``name`` is the family's key in the checkpoint (default: ``fam.name``).
    """
    name = fam.name if name is None else name
    if isinstance(fam, FamilyTheta):
        for b, W0 in enumerate(fam.shared):
            yield shared_key(name, b), W0
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


def family_entry(
    *,
    form: str,
    shape: Sequence[int],
    dtype: np.dtype,
    source_dtype: np.dtype,
    ranks: Sequence[int],
    bands: Sequence[int] | None,
    side: str | None = None,
    stored: int | None = None,
    errors: Sequence[float] | None = None,
    norms: Sequence[float] | None = None,
    **extra: object,
) -> dict:
    """One family's ``attnquant.json`` entry (format version 2)."""
    out_dim, in_dim = (int(d) for d in shape)
    entry: dict[str, object] = {
        "form": form,
        "side": side,
        "shape": [out_dim, in_dim],
        "dtype": dtype_name(dtype),
        "source_dtype": dtype_name(source_dtype),
        "rank": max(int(r) for r in ranks),
        "ranks": [int(r) for r in ranks],
        "bands": None if bands is None else [int(b) for b in bands],
        "blocks": None if bands is None else max(bands) + 1,
        "dense_parameters": len(ranks) * out_dim * in_dim,
    }
    if stored is not None:
        entry["stored_parameters"] = int(stored)
    if errors is not None and norms is not None:
        entry["errors"] = [float(e) for e in errors]
        entry["norms"] = [float(n) for n in norms]
        entry["error"] = pooled_error(entry["errors"], entry["norms"])  # type: ignore[arg-type]
    entry.update(extra)
    return entry


def stored_of(
    form: str,
    shape: Sequence[int],
    ranks: Sequence[int],
    bands: Sequence[int] | None,
    side: str | None = None,
) -> int:
    """Numbers a family of this form, ranks and bands stores (``s``, ``W0``, bases, ``U``, ``V``)."""
    out_dim, in_dim = shape
    if form == "banded":
        assert bands is not None
        G = max(bands) + 1
        return G * out_dim * in_dim + sum(out_dim + r * (out_dim + in_dim) for r in ranks)
    if form == "lowrank":
        return sum(r * (out_dim + in_dim) for r in ranks)
    assert bands is not None
    basis_dim, coef_dim = (in_dim, out_dim) if side == "in" else (out_dim, in_dim)
    widths = {b: ranks[i] for i, b in enumerate(bands)}
    return sum(basis_dim * k for k in widths.values()) + sum(coef_dim * k for k in ranks)


def _manifest(
    *,
    num_layers: int,
    stack: str,
    families: Mapping[str, dict],
    svd: SVDOptions | None,
    source: dict | None,
    **extra: object,
) -> dict:
    from . import __version__

    banded = [f for f in families.values() if f["form"] == "banded"]
    Gs = {max(f["bands"]) + 1 for f in banded}
    blocks = Gs.pop() if len(Gs) == 1 else None
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "writer": f"attnquant-core {__version__}",
        # The G every banded family shares (what ATTNQUANT_BLOCKS is checked against); null
        # when no family is banded or they disagree.
        "blocks": blocks,
        "num_layers": num_layers,
        "passthrough": len(banded) == len(families) and blocks == num_layers,
        "rank": max(f["rank"] for f in families.values()),
        "stack": stack,
        "forms": sorted({f["form"] for f in families.values()}),
        "svd": svd.to_json() if svd else None,
        **extra,
        "families": dict(families),
        "source": source or {},
    }


def decompose_checkpoint(
    src: str | Path | Checkpoint,
    out: str | Path,
    *,
    blocks: int | str | None = None,
    rank: int | None = None,
    budget: float | None = None,
    dtype: np.dtype | type | None = None,
    svd: SVDOptions = SVDOptions(),
    progress: Callable[[DecomposeProgress], None] | None = None,
    max_shard_bytes: int = 2 << 30,
    overwrite: bool = False,
) -> dict:
    """Decompose every projection family of a checkpoint into a theta checkpoint at ``out``.

    With ``blocks`` (default 1) and ``rank`` (default 16): every family banded, ``G`` bands,
    rank ``r``. With ``budget`` (stored / dense parameters, in ``(0, 1]``) instead: the form and
    the ranks of each family and layer are chosen to minimise the total squared error at that
    size (:func:`attnquant_core.decompose_budget`); ``budget`` excludes ``blocks`` and ``rank``.

    Streams: each band's ``W0`` is accumulated one layer at a time, then each layer is read
    again for ``s``, the residual and its SVD, and written in place; peak memory follows the
    largest single weight, not the number of layers. ``dtype`` is the storage dtype (default:
    each family's source dtype). Returns the ``attnquant.json`` manifest. Nothing is left at
    ``out`` if anything fails.
    """
    if budget is not None:
        if blocks is not None or rank is not None:
            raise DecompositionError(
                "budget= chooses every family's form, bands and ranks; pass either budget= "
                "or blocks=/rank=, not both"
            )
        from ._budget import decompose_budget

        report = decompose_budget(
            src,
            out,
            budget=budget,
            dtype=dtype,
            svd=svd,
            progress=progress,
            max_shard_bytes=max_shard_bytes,
            overwrite=overwrite,
        )
        assert report.manifest is not None
        return report.manifest
    blocks = 1 if blocks is None else blocks
    rank = 16 if rank is None else rank
    ckpt = src if isinstance(src, Checkpoint) else open_checkpoint(src)
    L = ckpt.num_layers
    G = resolve_blocks(blocks, L)
    bands = band_of_layers(L, G)
    sizes = band_sizes(L, G)
    copied = _copied_specs(ckpt)

    specs: dict[str, TensorSpec] = dict(copied)
    store: dict[str, np.dtype] = {}
    for name, info in ckpt.families.items():
        check_rank(name, info.shape, rank)
        store[name] = np.dtype(dtype) if dtype is not None else info.dtype
        specs.update(
            _plain_specs(
                family_specs(
                    name,
                    info.stack,
                    form="banded",
                    shape=info.shape,
                    dtype=store[name],
                    ranks=[rank] * L,
                    bands=bands,
                )
            )
        )

    digests: dict[str, str] = {}
    families: dict[str, dict] = {}
    with atomic_directory(Path(out), overwrite) as tmp:
        copy_side_files(ckpt.directory if ckpt.path.is_dir() else None, tmp)
        with PlannedWriter(tmp, specs, max_shard_bytes=max_shard_bytes) as writer:
            _write_copied(writer, ckpt, copied, digests)
            for name, info in ckpt.families.items():
                errors: list[float] = []
                norms: list[float] = []
                start = 0
                for b, size in enumerate(sizes):
                    layers = range(start, start + size)
                    held: np.ndarray | None = None
                    cdt = compute_dtype(np.result_type(info.dtype, store[name]))
                    acc = np.zeros(info.shape, cdt)
                    for layer in layers:  # pass 1: the band mean, one layer at a time
                        W = ckpt.get(info.keys[layer], check_finite=True)
                        digests[info.keys[layer]] = _digest(W)
                        acc += W
                        held = W if size == 1 else None
                        del W
                    acc /= size
                    W0 = acc.astype(store[name])
                    del acc
                    writer.write(shared_key(name, b), W0)
                    for layer in layers:  # pass 2: s, residual, SVD, one layer at a time
                        W = held if held is not None else ckpt.get(info.keys[layer])
                        fit = fit_layer(W, W0, rank, dtype=store[name], svd=svd, seed=(b, layer))
                        del W
                        for part in ("s", "U", "V"):
                            writer.write(
                                theta_key(info.stack, layer, name, part), getattr(fit.theta, part)
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
                )
        manifest = _manifest(
            num_layers=L,
            stack=ckpt.stack,
            families=families,
            svd=svd,
            source={"path": str(ckpt.path), "digests": digests},
        )
        _write_manifest(tmp, manifest)
    return manifest


def _digest(array: np.ndarray) -> str:
    return "sha256:" + hashlib.sha256(np.ascontiguousarray(array).view(np.uint8).data).hexdigest()


def _copied_specs(ckpt: Checkpoint) -> dict[str, TensorSpec]:
    """The tensors a theta checkpoint copies unchanged from ``ckpt``: all but the projections."""
    projection_keys = ckpt.projection_keys()
    return {k: ckpt.spec(k) for k in ckpt.keys() if k not in projection_keys}


def _write_copied(
    writer: PlannedWriter, ckpt: Checkpoint, keys: Iterable[str], digests: dict[str, str]
) -> None:
    """Copy each of ``keys`` from ``ckpt`` (checked finite) to ``writer``, one tensor at a time,
    recording its source digest in ``digests``."""
    for key in keys:
        array = ckpt.get(key, check_finite=True)
        digests[key] = _digest(array)
        writer.write(key, array)
        del array


def _write_manifest(directory: Path, manifest: Mapping) -> None:
    """Write ``manifest`` as ``directory/attnquant.json``."""
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")


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
            _plain_specs(
                family_specs(
                    name,
                    model.stack,
                    form=fam.form,
                    shape=fam.shape,
                    dtype=dtype,
                    ranks=fam.ranks,
                    bands=fam.bands,
                    side=fam.side,
                )
            )
        )
        errs = errors.get(name) if errors else None
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
        manifest = _manifest(
            num_layers=model.num_layers,
            stack=model.stack,
            families=families,
            svd=None,
            source=None,
            **dict(extra or {}),
        )
        _write_manifest(tmp, manifest)
    return manifest


# -- reading -------------------------------------------------------------------------------


def _read_json_manifest(
    directory: Path, name: str, *, what: str, error: type[AttnquantError]
) -> tuple[Path, Any]:
    """``directory / name`` and its parsed JSON; ``error`` when the file is absent (``directory``
    is not ``what``) or is not valid JSON."""
    manifest_file = directory / name
    if not manifest_file.is_file():
        raise error(f"{directory}: not {what} (no {name})")
    try:
        return manifest_file, json.loads(manifest_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise error(f"{manifest_file}: not valid JSON ({exc})") from exc


class ThetaCheckpoint:
    """A theta checkpoint opened lazily and validated against its manifest.

    ``blocks``, when given, is the ``G`` the caller expects (``ATTNQUANT_BLOCKS`` at serving);
    a banded family decomposed with another ``G`` fails listing the layers whose band differs.
    Families in the other forms (low rank, shared basis) have no ``W0`` and are not checked
    against ``blocks``.

    The manifest is read in any format version up to :data:`FORMAT_VERSION` and kept in the
    version-2 shape (``self.manifest``): a version-1 family gains ``"form": "banded"``,
    ``"side": None`` and ``"ranks"``.
    """

    def __init__(self, path: Path, manifest: dict, tensors: SafetensorsFiles, config: dict | None):
        self.path = path
        self.manifest = manifest
        self.tensors = tensors
        self.config = config

    # construction ---------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | Path, *, blocks: int | str | None = None) -> ThetaCheckpoint:
        """Open and validate a theta checkpoint directory (headers only, no tensor data)."""
        path = Path(path)
        manifest_file, manifest = _read_json_manifest(
            path, MANIFEST_FILE, what="a theta checkpoint", error=ThetaFormatError
        )
        manifest = _check_manifest(manifest_file, manifest)
        tensors, config = read_tensor_directory(path)
        self = cls(path, manifest, tensors, config)
        self._validate(blocks)
        if config is not None:
            check_config_dims(
                path / "config.json",
                config,
                num_layers=manifest["num_layers"],
                projections={
                    name: (f"{manifest_file.name} family {name}", tuple(fam["shape"]))
                    for name, fam in manifest["families"].items()
                    if name in FAMILIES
                },
                embedding=embedding_spec(tensors, manifest["stack"]),
            )
        return self

    def _expected_bands(self, name: str, fam: dict) -> tuple[list[int], int, str | None]:
        """The canonical band map of a banded or shared-basis family, its ``G``, and a problem."""
        L = self.num_layers
        recorded = list(fam["bands"])
        top = self.manifest["blocks"]
        G = int(top) if fam["form"] == "banded" and top is not None else max(recorded) + 1
        if not 1 <= G <= L:
            return recorded, G, f"{name}: blocks={G} is outside 1..{L}"
        expected = band_of_layers(L, G)
        if recorded != expected:
            diff = [i for i in range(L) if i >= len(recorded) or recorded[i] != expected[i]]
            return (
                expected,
                G,
                f"{name}: layers {diff} are recorded in other bands than blocks={G} gives "
                f"(recorded {recorded}, expected {expected})",
            )
        return expected, G, None

    def _validate(self, blocks: int | str | None) -> None:
        L = self.num_layers
        band_problems: list[str] = []  # banded families: W0 and band maps
        other_problems: list[str] = []  # the other forms, stray keys
        referenced: set[str] = set()
        banded_G: dict[str, int] = {}
        for name, fam in self.families.items():
            form = fam["form"]
            problems = band_problems if form == "banded" else other_problems
            bands = None
            if form != "lowrank":
                bands, G, problem = self._expected_bands(name, fam)
                if problem is not None:
                    problems.append(problem)
                    continue
                if form == "banded":
                    banded_G[name] = G
                else:
                    uneven = [
                        i
                        for i in range(L)
                        if fam["ranks"][i] != fam["ranks"][bands.index(bands[i])]
                    ]
                    if uneven:
                        problems.append(
                            f"{name}: layers {uneven} record another rank than the first layer "
                            f"of their band (a shared basis has one width per band)"
                        )
                        continue
            want = family_specs(
                name,
                self.stack,
                form=form,
                shape=tuple(fam["shape"]),
                dtype=dtype_from_name(fam["dtype"]),
                ranks=fam["ranks"],
                bands=bands,
                side=fam["side"],
            )
            bad_layers: dict[int, list[str]] = {}
            for key, (spec, layers) in want.items():
                referenced.add(key)
                have = self.tensors.spec(key) if key in self.tensors else None
                if have == spec:
                    continue
                why = "missing" if have is None else f"{have.dtype}{list(have.shape)}"
                msg = f"{key} ({why}, expected {spec.dtype}{list(spec.shape)})"
                for layer in layers:
                    bad_layers.setdefault(layer, []).append(msg)
            for layer in sorted(bad_layers):
                problems.append(f"{name} layer {layer}: " + "; ".join(bad_layers[layer]))
        stray = sorted(
            k
            for k in self.tensors.keys()
            if (k.startswith("attnquant.shared.") or ".theta_" in k) and k not in referenced
        )
        if stray and not band_problems and not other_problems:
            other_problems.append(
                f"theta keys the manifest does not describe: {', '.join(stray[:8])}"
            )
        want_G = None if blocks is None else resolve_blocks(blocks, L)
        if want_G is not None and banded_G:
            wanted = band_of_layers(L, want_G)
            off = {n: g for n, g in banded_G.items() if g != want_G}
            for G in sorted(set(off.values()), reverse=True):
                names = [n for n, g in off.items() if g == G]
                moved = [i for i in range(L) if wanted[i] != band_of_layers(L, G)[i]]
                which = "" if len(names) == len(banded_G) else f"{', '.join(names)}: "
                band_problems.insert(
                    0,
                    f"{which}decomposed with blocks={G}, asked to serve blocks={want_G}: "
                    f"layers {moved} have no band-compatible W0",
                )
        if band_problems:
            raise BandMismatchError(
                f"{self.path}: theta keys do not match a shape- and band-compatible W0; "
                f"{BLOCKS_HINT}. " + " | ".join(band_problems + other_problems)
            )
        if other_problems:
            raise ThetaFormatError(
                f"{self.path}: theta keys do not match attnquant.json: "
                + " | ".join(other_problems)
            )

    # manifest facts --------------------------------------------------------------------------
    @property
    def format_version(self) -> int:
        """The format version the checkpoint was written in."""
        return int(self.manifest["format_version"])

    @property
    def blocks(self) -> int | None:
        """The ``G`` every banded family shares (``None`` when none is banded or they differ)."""
        G = self.manifest["blocks"]
        return None if G is None else int(G)

    @property
    def rank(self) -> int:
        """The largest rank of any layer of any family."""
        return int(self.manifest["rank"])

    @property
    def num_layers(self) -> int:
        return int(self.manifest["num_layers"])

    @property
    def stack(self) -> str:
        return str(self.manifest["stack"])

    @property
    def passthrough(self) -> bool:
        """Whether every family is banded with ``G = L``, so every weight rebuilds exactly."""
        return all(f["form"] == "banded" for f in self.families.values()) and (
            self.blocks == self.num_layers
        )

    @property
    def families(self) -> dict[str, dict]:
        """Every family's manifest entry (version-2 shape)."""
        return self.manifest["families"]

    @property
    def forms(self) -> dict[str, str]:
        """The form of every family."""
        return {n: f["form"] for n, f in self.families.items()}

    def ranks(self, family: str) -> list[int]:
        """The rank of every layer of ``family``."""
        return list(self.families[family]["ranks"])

    # tensors ---------------------------------------------------------------------------------
    def _entry(self, family: str, form: str | None = None) -> dict:
        fam = self.families.get(family)
        if fam is None:
            raise ThetaFormatError(f"{self.path}: no family {family!r} in the checkpoint")
        if form is not None and fam["form"] != form:
            raise ThetaFormatError(
                f"{self.path}: family {family} is stored as {fam['form']!r}, not {form!r}; "
                f"use family_theta() or factors(), which read every form"
            )
        return fam

    def shared(self, family: str, band: int) -> np.ndarray:
        """The stored ``W0`` of one band of a banded family."""
        self._entry(family, "banded")
        return self.tensors.get(shared_key(family, band))

    def basis(self, family: str, band: int) -> np.ndarray:
        """The stored basis of one band of a shared-basis family."""
        self._entry(family, "shared_basis")
        return self.tensors.get(basis_key(family, band))

    def layer(self, family: str, layer: int) -> LayerTheta:
        """The stored ``s``, ``U``, ``V`` of one layer of a banded family."""
        self._entry(family, "banded")
        get = self.tensors.get
        return LayerTheta(
            s=get(theta_key(self.stack, layer, family, "s")),
            U=get(theta_key(self.stack, layer, family, "U")),
            V=get(theta_key(self.stack, layer, family, "V")),
        )

    def factors(
        self, family: str, layer: int, *, shared: np.ndarray | None = None
    ) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray, np.ndarray]:
        """The identity's parts ``(s, W0, U, V)`` of one layer, in any form.

        ``shared`` is the layer's band tensor (``W0`` or basis) when the caller holds it.
        """
        fam = self._entry(family)
        get = self.tensors.get
        key = partial(theta_key, self.stack, layer, family)
        form = fam["form"]
        if form == "lowrank":
            return None, None, get(key("U")), get(key("V"))
        band = fam["bands"][layer]
        if form == "banded":
            W0 = shared if shared is not None else get(shared_key(family, band))
            return get(key("s")), W0, get(key("U")), get(key("V"))
        B = shared if shared is not None else get(basis_key(family, band))
        if fam["side"] == "in":
            return None, None, get(key("U")), B
        return None, None, B, get(key("V"))

    def family(self, family: str) -> FamilyTheta:
        """Load one whole banded family into memory (the type the in-graph paths read).

        Raises :class:`ThetaFormatError` for a family in another form; :meth:`family_theta`
        reads every form.
        """
        fam = self._entry(family, "banded")
        return FamilyTheta(
            name=family,
            shared=tuple(self.shared(family, b) for b in range(max(fam["bands"]) + 1)),
            bands=tuple(fam["bands"]),
            layers=tuple(self.layer(family, i) for i in range(self.num_layers)),
        )

    def family_theta(self, family: str) -> ThetaFamily:
        """Load one whole family, in whatever form it is stored."""
        fam = self._entry(family)
        L = self.num_layers
        get = self.tensors.get
        if fam["form"] == "banded":
            return self.family(family)
        if fam["form"] == "lowrank":
            return LowRankFamily(
                name=family,
                U=tuple(get(theta_key(self.stack, i, family, "U")) for i in range(L)),
                V=tuple(get(theta_key(self.stack, i, family, "V")) for i in range(L)),
            )
        part = "U" if fam["side"] == "in" else "V"
        return SharedBasisFamily(
            name=family,
            side=fam["side"],
            bases=tuple(self.basis(family, b) for b in range(max(fam["bands"]) + 1)),
            bands=tuple(fam["bands"]),
            coefs=tuple(get(theta_key(self.stack, i, family, part)) for i in range(L)),
        )

    def load(self) -> ThetaModel:
        """Load every family (any form) and every other tensor into a :class:`ThetaModel`."""
        return ThetaModel(
            families={name: self.family_theta(name) for name in self.families},
            stack=self.stack,
            extra={k: self.tensors.get(k) for k in self.copied_keys()},
        )

    def _source_dtype(self, family: str) -> np.dtype:
        fam = self.families[family]
        return dtype_from_name(fam.get("source_dtype", fam["dtype"]))

    def rebuild(self, family: str, layer: int) -> np.ndarray:
        """``W_eff`` of one layer in the family's source dtype (any form)."""
        return reconstruct(*self.factors(family, layer)).astype(self._source_dtype(family))

    def copied_keys(self) -> list[str]:
        """Dense tensors stored as they were (embeddings, norms, heads)."""
        return [
            k
            for k in self.tensors.keys()
            if not k.startswith("attnquant.shared.") and ".theta_" not in k
        ]

    def stock_keys(self) -> list[str]:
        """Every dense key of the rebuilt model, original names."""
        keys = set(self.copied_keys())
        for name in self.families:
            keys.update(dense_key(self.stack, i, name) for i in range(self.num_layers))
        return sorted(keys)

    def rebuilt_state(self) -> Iterator[tuple[str, np.ndarray]]:
        """Every stock key with its array; projections rebuilt one layer at a time, any form.

        This is what the precompute-outside path loads, so every form serves there.
        """
        for key in self.copied_keys():
            yield key, self.tensors.get(key)
        for name, fam in self.families.items():
            dtype = self._source_dtype(name)
            band, held = -1, None
            for layer in range(self.num_layers):
                if fam["form"] != "lowrank" and fam["bands"][layer] != band:
                    band = fam["bands"][layer]  # consecutive layers of a band share one tensor
                    key = shared_key if fam["form"] == "banded" else basis_key
                    held = self.tensors.get(key(name, band))
                W = reconstruct(*self.factors(name, layer, shared=held)).astype(dtype)
                yield dense_key(self.stack, layer, name), W


def _int_list(where: Path, name: str, field: str, value: object, length: int) -> list[int]:
    if (
        not isinstance(value, list)
        or len(value) != length
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
    ):
        raise ThetaFormatError(
            f"{where}: family {name} has {field}={value!r}; expected {length} whole numbers >= 0"
        )
    return list(value)


def _check_manifest(where: Path, m: object) -> dict:
    """Check a manifest of any readable version and return it in the version-2 shape."""
    if not isinstance(m, dict) or m.get("format") != FORMAT_NAME:
        raise ThetaFormatError(f"{where}: not an {FORMAT_NAME} manifest")
    version = m.get("format_version")
    if not isinstance(version, int) or version < 1:
        raise ThetaFormatError(f"{where}: bad format_version {version!r}")
    if version > FORMAT_VERSION:
        raise ThetaFormatError(
            f"{where}: format version {version} was written by a newer attnquant; this "
            f"attnquant-core reads up to version {FORMAT_VERSION}: upgrade attnquant-core"
        )
    for field in ("blocks", "num_layers", "rank", "stack", "families"):
        if field not in m:
            raise ThetaFormatError(f"{where}: manifest has no {field!r}")
    L = m["num_layers"]
    if not isinstance(L, int) or L < 1:
        raise ThetaFormatError(f"{where}: bad num_layers {L!r}")
    if not isinstance(m["families"], dict) or not m["families"]:
        raise ThetaFormatError(f"{where}: manifest lists no families")
    if m["blocks"] is not None and not isinstance(m["blocks"], int):
        raise ThetaFormatError(f"{where}: bad blocks {m['blocks']!r}")
    if version == 1 and m["blocks"] is None:
        raise ThetaFormatError(f"{where}: a version 1 manifest needs an integer 'blocks'")
    m = dict(m)
    families: dict[str, dict] = {}
    for name, fam in m["families"].items():
        fam = dict(fam)
        required = (
            ("shape", "dtype", "rank", "bands")
            if version == 1
            else ("shape", "dtype", "form", "ranks")
        )
        for field in required:
            if field not in fam:
                raise ThetaFormatError(f"{where}: family {name} has no {field!r}")
        form = fam.setdefault("form", "banded")
        if form not in FORMS or (version == 1 and form != "banded"):
            raise ThetaFormatError(
                f"{where}: family {name} has form {form!r}, which this version cannot read"
            )
        _int_list(where, name, "shape", fam["shape"], 2)
        if version == 1:
            fam["ranks"] = [fam["rank"]] * L
        fam["ranks"] = _int_list(where, name, "ranks", fam["ranks"], L)
        fam["rank"] = max(fam["ranks"])
        if form == "lowrank":
            fam["bands"], fam["side"] = None, None
        else:
            if not fam.get("bands"):
                raise ThetaFormatError(f"{where}: family {name} ({form}) has no 'bands'")
            fam["bands"] = _int_list(where, name, "bands", fam["bands"], L)
            fam["blocks"] = max(fam["bands"]) + 1
            side = fam.get("side")
            if form == "shared_basis" and side not in SIDES:
                raise ThetaFormatError(
                    f"{where}: family {name} (shared_basis) has side {side!r}; "
                    f"expected one of {', '.join(SIDES)}"
                )
            fam["side"] = side if form == "shared_basis" else None
        families[name] = fam
    m["families"] = families
    return m


def rebuild_dense_state(
    ckpt: Checkpoint | str | Path,
    *,
    blocks: int | str = "layers",
    rank: int = 16,
    svd: SVDOptions = SVDOptions(),
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
    for name, info in ckpt.families.items():
        weights = [ckpt.get(k, check_finite=True) for k in info.keys]
        theta, _ = decompose_family(weights, blocks=blocks, rank=rank, name=name, svd=svd)
        del weights
        for layer, key in enumerate(info.keys):
            yield key, theta.reconstruct(layer).astype(info.dtype)
