"""The theta checkpoint (DESIGN §4): a Hugging Face directory plus theta keys and ``attnquant.json``.

Writes go to a temporary directory that is renamed into place when complete; reads are lazy
(headers at open, tensors on demand) and validate every theta key against its band's ``W0``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ._bands import band_of_layers, band_sizes, resolve_blocks
from ._checkpoint import INDEX_FILE, Checkpoint, open_checkpoint, read_tensor_directory
from ._decompose import (
    FamilyErrors,
    SVDOptions,
    check_rank,
    decompose_family,
    fit_layer,
    pooled_error,
)
from ._errors import BandMismatchError, ThetaFormatError
from ._safetensors_io import (
    PlannedWriter,
    SafetensorsFiles,
    TensorSpec,
    dtype_from_name,
    dtype_name,
)
from ._svd import compute_dtype
from ._theta import FamilyTheta, LayerTheta, ThetaModel, reconstruct

__all__ = [
    "FORMAT_NAME",
    "atomic_directory",
    "copy_side_files",
    "FORMAT_VERSION",
    "MANIFEST_FILE",
    "DecomposeProgress",
    "ThetaCheckpoint",
    "decompose_checkpoint",
    "is_theta_checkpoint",
    "rebuild_dense_state",
    "save_theta",
    "shared_key",
    "theta_key",
]

FORMAT_NAME = "attnquant-theta"
FORMAT_VERSION = 1
MANIFEST_FILE = "attnquant.json"
BLOCKS_HINT = "this almost always means ATTNQUANT_BLOCKS differs between decomposition and serving"


def theta_key(stack: str, layer: int, family: str, part: str) -> str:
    """``model.layers.3.self_attn.q_proj.theta_U`` for ``part`` in ``s``, ``U``, ``V``."""
    return f"{stack}.{layer}.{family}.theta_{part}"


def shared_key(family: str, band: int) -> str:
    """``attnquant.shared.self_attn.q_proj.0.W0``."""
    return f"attnquant.shared.{family}.{band}.W0"


def dense_key(stack: str, layer: int, family: str) -> str:
    return f"{stack}.{layer}.{family}.weight"


def is_theta_checkpoint(path: str | Path) -> bool:
    """True when ``path`` is a directory holding an ``attnquant.json``."""
    return (Path(path) / MANIFEST_FILE).is_file()


@dataclass(frozen=True)
class DecomposeProgress:
    """One layer done, reported to the ``progress`` callback of :func:`decompose_checkpoint`."""

    family: str
    layer: int
    num_layers: int
    error: float


# -- writing -------------------------------------------------------------------------------


@contextlib.contextmanager
def atomic_directory(out: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of ``out``; rename it to ``out`` only if the block succeeds."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; remove it or pass overwrite=True")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def copy_side_files(src_dir: Path | None, dst: Path) -> None:
    """Copy config, tokenizer and other non-tensor files of a checkpoint directory into ``dst``."""
    if src_dir is None or not src_dir.is_dir():
        return
    for item in sorted(src_dir.iterdir()):
        if (
            item.is_file()
            and item.suffix != ".safetensors"
            and item.name not in {INDEX_FILE, MANIFEST_FILE}
            and not item.name.startswith(".")
        ):
            shutil.copy2(item, dst / item.name)


def _family_specs(
    name: str, stack: str, shape: tuple[int, int], dtype: np.dtype, rank: int, bands: list[int]
) -> dict[str, TensorSpec]:
    out_dim, in_dim = shape
    specs = {shared_key(name, b): TensorSpec(dtype, shape) for b in range(max(bands) + 1)}
    for layer in range(len(bands)):
        specs[theta_key(stack, layer, name, "s")] = TensorSpec(dtype, (out_dim,))
        specs[theta_key(stack, layer, name, "U")] = TensorSpec(dtype, (out_dim, rank))
        specs[theta_key(stack, layer, name, "V")] = TensorSpec(dtype, (in_dim, rank))
    return specs


def _manifest(
    *,
    blocks: int,
    num_layers: int,
    rank: int,
    stack: str,
    families: Mapping[str, dict],
    svd: SVDOptions | None,
    source: dict | None,
) -> dict:
    from . import __version__

    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "writer": f"attnquant-core {__version__}",
        "blocks": blocks,
        "num_layers": num_layers,
        "passthrough": blocks == num_layers,
        "rank": rank,
        "stack": stack,
        "svd": svd.to_json() if svd else None,
        "families": dict(families),
        "source": source or {},
    }


def decompose_checkpoint(
    src: str | Path | Checkpoint,
    out: str | Path,
    *,
    blocks: int | str = 1,
    rank: int = 16,
    dtype: np.dtype | type | None = None,
    svd: SVDOptions = SVDOptions(),
    progress: Callable[[DecomposeProgress], None] | None = None,
    max_shard_bytes: int = 2 << 30,
    overwrite: bool = False,
) -> dict:
    """Decompose every projection family of a checkpoint into a theta checkpoint at ``out``.

    Streams: each band's ``W0`` is accumulated one layer at a time, then each layer is read
    again for ``s``, the residual and its SVD, and written in place; peak memory follows the
    largest single weight, not the number of layers. ``dtype`` is the storage dtype (default:
    each family's source dtype). Returns the ``attnquant.json`` manifest. Nothing is left at
    ``out`` if anything fails.
    """
    ckpt = src if isinstance(src, Checkpoint) else open_checkpoint(src)
    L = ckpt.num_layers
    G = resolve_blocks(blocks, L)
    bands = band_of_layers(L, G)
    sizes = band_sizes(L, G)
    projection_keys = ckpt.projection_keys()
    copied = [k for k in ckpt.keys() if k not in projection_keys]

    specs: dict[str, TensorSpec] = {k: ckpt.spec(k) for k in copied}
    store: dict[str, np.dtype] = {}
    for name, info in ckpt.families.items():
        check_rank(name, info.shape, rank)
        store[name] = np.dtype(dtype) if dtype is not None else info.dtype
        specs.update(_family_specs(name, info.stack, info.shape, store[name], rank, bands))

    digests: dict[str, str] = {}
    families: dict[str, dict] = {}
    with atomic_directory(Path(out), overwrite) as tmp:
        copy_side_files(ckpt.directory if ckpt.path.is_dir() else None, tmp)
        with PlannedWriter(tmp, specs, max_shard_bytes=max_shard_bytes) as writer:
            for key in copied:
                array = ckpt.get(key, check_finite=True)
                digests[key] = _digest(array)
                writer.write(key, array)
                del array
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
                families[name] = {
                    "form": "banded",
                    "shape": list(info.shape),
                    "dtype": dtype_name(store[name]),
                    "source_dtype": dtype_name(info.dtype),
                    "rank": rank,
                    "bands": bands,
                    "errors": errors,
                    "norms": norms,
                    "error": pooled_error(errors, norms),
                }
        manifest = _manifest(
            blocks=G,
            num_layers=L,
            rank=rank,
            stack=ckpt.stack,
            families=families,
            svd=svd,
            source={"path": str(ckpt.path), "digests": digests},
        )
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _digest(array: np.ndarray) -> str:
    return "sha256:" + hashlib.sha256(np.ascontiguousarray(array).view(np.uint8).data).hexdigest()


def save_theta(
    model: ThetaModel,
    out: str | Path,
    *,
    config: Mapping | None = None,
    source_dir: str | Path | None = None,
    errors: Mapping[str, FamilyErrors] | None = None,
    overwrite: bool = False,
) -> dict:
    """Write an in-memory :class:`ThetaModel` (and its ``extra`` dense tensors) as a theta checkpoint."""
    specs: dict[str, TensorSpec] = {
        k: TensorSpec(v.dtype, tuple(v.shape)) for k, v in model.extra.items()
    }
    families: dict[str, dict] = {}
    for name, fam in model.families.items():
        ranks = {t.rank for t in fam.layers}
        dtypes = {a.dtype for a in fam.shared} | {
            a.dtype for t in fam.layers for a in (t.s, t.U, t.V)
        }
        if len(ranks) != 1 or len(dtypes) != 1:
            raise ThetaFormatError(
                f"{name}: format version {FORMAT_VERSION} stores one rank and one dtype per family; "
                f"got ranks {sorted(ranks)} and dtypes {sorted(map(str, dtypes))}"
            )
        dtype = dtypes.pop()
        specs.update(_family_specs(name, model.stack, fam.shape, dtype, fam.rank, list(fam.bands)))
        families[name] = {
            "form": "banded",
            "shape": list(fam.shape),
            "dtype": dtype_name(dtype),
            "source_dtype": dtype_name(dtype),
            "rank": fam.rank,
            "bands": list(fam.bands),
            **(
                {
                    "errors": errors[name].errors,
                    "norms": errors[name].norms,
                    "error": errors[name].total,
                }
                if errors and name in errors
                else {}
            ),
        }
    with atomic_directory(Path(out), overwrite) as tmp:
        if source_dir is not None:
            copy_side_files(Path(source_dir), tmp)
        if config is not None:
            (tmp / "config.json").write_text(json.dumps(dict(config), indent=2) + "\n")
        with PlannedWriter(tmp, specs) as writer:
            for key, array in model.extra.items():
                writer.write(key, array)
            for name, fam in model.families.items():
                for b, W0 in enumerate(fam.shared):
                    writer.write(shared_key(name, b), W0)
                for layer, t in enumerate(fam.layers):
                    for part in ("s", "U", "V"):
                        writer.write(theta_key(model.stack, layer, name, part), getattr(t, part))
        manifest = _manifest(
            blocks=model.blocks,
            num_layers=model.num_layers,
            rank=model.rank,
            stack=model.stack,
            families=families,
            svd=None,
            source=None,
        )
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


# -- reading -------------------------------------------------------------------------------


class ThetaCheckpoint:
    """A theta checkpoint opened lazily and validated against its manifest.

    ``blocks``, when given, is the ``G`` the caller expects (``ATTNQUANT_BLOCKS`` at serving);
    a checkpoint decomposed with another ``G`` fails listing the layers whose band differs.
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
        manifest_file = path / MANIFEST_FILE
        if not manifest_file.is_file():
            raise ThetaFormatError(f"{path}: not a theta checkpoint (no {MANIFEST_FILE})")
        try:
            manifest = json.loads(manifest_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ThetaFormatError(f"{manifest_file}: not valid JSON ({exc})") from exc
        _check_manifest(manifest_file, manifest)
        tensors, config = read_tensor_directory(path)
        self = cls(path, manifest, tensors, config)
        self._validate(blocks)
        return self

    def _validate(self, blocks: int | str | None) -> None:
        L, G = self.num_layers, self.blocks
        expected = band_of_layers(L, G)
        problems: list[str] = []
        referenced: set[str] = set()
        for name, fam in self.families.items():
            recorded = list(fam["bands"])
            if recorded != expected:
                diff = [i for i in range(L) if i >= len(recorded) or recorded[i] != expected[i]]
                problems.append(
                    f"{name}: layers {diff} are recorded in other bands than blocks={G} gives "
                    f"(recorded {recorded}, expected {expected})"
                )
                continue
            out_dim, in_dim = fam["shape"]
            r = fam["rank"]
            dtype = dtype_from_name(fam["dtype"])
            want = _family_specs(name, self.stack, (out_dim, in_dim), dtype, r, expected)
            bad_layers: dict[int, list[str]] = {}
            for key, spec in want.items():
                referenced.add(key)
                have = self.tensors.spec(key) if key in self.tensors else None
                if have == spec:
                    continue
                why = "missing" if have is None else f"{have.dtype}{list(have.shape)}"
                msg = f"{key} ({why}, expected {spec.dtype}{list(spec.shape)})"
                if key.startswith("attnquant.shared."):
                    band = int(key.split(".")[-2])
                    for layer in (i for i, b in enumerate(expected) if b == band):
                        bad_layers.setdefault(layer, []).append(msg)
                else:
                    layer = int(key[len(self.stack) + 1 :].split(".")[0])
                    bad_layers.setdefault(layer, []).append(msg)
            for layer in sorted(bad_layers):
                problems.append(f"{name} layer {layer}: " + "; ".join(bad_layers[layer]))
        stray = sorted(
            k
            for k in self.tensors.keys()
            if (k.startswith("attnquant.shared.") or ".theta_" in k) and k not in referenced
        )
        if stray and not problems:
            problems.append(f"theta keys the manifest does not describe: {', '.join(stray[:8])}")
        if blocks is not None:
            want_G = resolve_blocks(blocks, L)
            if want_G != G:
                wanted = band_of_layers(L, want_G)
                moved = [i for i in range(L) if wanted[i] != expected[i]]
                problems.insert(
                    0,
                    f"decomposed with blocks={G}, asked to serve blocks={want_G}: layers {moved} "
                    f"have no band-compatible W0",
                )
        if problems:
            raise BandMismatchError(
                f"{self.path}: theta keys do not match a shape- and band-compatible W0; "
                f"{BLOCKS_HINT}. " + " | ".join(problems)
            )

    # manifest facts --------------------------------------------------------------------------
    @property
    def blocks(self) -> int:
        return int(self.manifest["blocks"])

    @property
    def rank(self) -> int:
        return int(self.manifest["rank"])

    @property
    def num_layers(self) -> int:
        return int(self.manifest["num_layers"])

    @property
    def stack(self) -> str:
        return str(self.manifest["stack"])

    @property
    def passthrough(self) -> bool:
        return self.blocks == self.num_layers

    @property
    def families(self) -> dict[str, dict]:
        return self.manifest["families"]

    # tensors ---------------------------------------------------------------------------------
    def shared(self, family: str, band: int) -> np.ndarray:
        """The stored ``W0`` of one band."""
        return self.tensors.get(shared_key(family, band))

    def layer(self, family: str, layer: int) -> LayerTheta:
        """The stored ``s``, ``U``, ``V`` of one layer."""
        get = self.tensors.get
        return LayerTheta(
            s=get(theta_key(self.stack, layer, family, "s")),
            U=get(theta_key(self.stack, layer, family, "U")),
            V=get(theta_key(self.stack, layer, family, "V")),
        )

    def family(self, family: str) -> FamilyTheta:
        """Load one whole family into memory."""
        fam = self.families[family]
        return FamilyTheta(
            name=family,
            shared=tuple(self.shared(family, b) for b in range(max(fam["bands"]) + 1)),
            bands=tuple(fam["bands"]),
            layers=tuple(self.layer(family, i) for i in range(self.num_layers)),
        )

    def load(self) -> ThetaModel:
        """Load every family and every other tensor into a :class:`ThetaModel`."""
        return ThetaModel(
            families={name: self.family(name) for name in self.families},
            stack=self.stack,
            extra={k: self.tensors.get(k) for k in self.copied_keys()},
        )

    def rebuild(self, family: str, layer: int) -> np.ndarray:
        """``W_eff`` of one layer in the family's source dtype."""
        fam = self.families[family]
        t = self.layer(family, layer)
        W = reconstruct(t.s, self.shared(family, fam["bands"][layer]), t.U, t.V)
        return W.astype(dtype_from_name(fam.get("source_dtype", fam["dtype"])))

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
        """Every stock key with its array; projections rebuilt one layer at a time."""
        for key in self.copied_keys():
            yield key, self.tensors.get(key)
        for name, fam in self.families.items():
            dtype = dtype_from_name(fam.get("source_dtype", fam["dtype"]))
            band, W0 = -1, None
            for layer in range(self.num_layers):
                if fam["bands"][layer] != band:  # consecutive layers of a band share one W0
                    band = fam["bands"][layer]
                    W0 = self.shared(name, band)
                t = self.layer(name, layer)
                W = reconstruct(t.s, W0, t.U, t.V).astype(dtype)
                yield dense_key(self.stack, layer, name), W


def _check_manifest(where: Path, m: object) -> None:
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
    for name, fam in m["families"].items():
        for field in ("shape", "dtype", "rank", "bands"):
            if field not in fam:
                raise ThetaFormatError(f"{where}: family {name} has no {field!r}")
        if fam.get("form", "banded") != "banded":
            raise ThetaFormatError(
                f"{where}: family {name} has form {fam['form']!r}, which this version cannot read"
            )


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
