"""Reading a theta checkpoint: lazy (headers at open, tensors on demand), every theta key validated
against its band's ``W0`` and the manifest.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from pathlib import Path

import numpy as np

from .._errors import (
    BandMismatchError,
    ThetaFormatError,
)
from ..forms._banded import FamilyTheta, LayerTheta
from ..forms._bands import band_of_layers, group_blocks, resolve_blocks
from ..forms._factored import LowRankFamily, SharedBasisFamily
from ..forms._identity import reconstruct
from ..forms._model import ThetaFamily, ThetaModel
from ..forms._nvfp4 import NVFP4Error, NVFP4Tensor, dequantize_nvfp4
from ._checkpoint import (
    FAMILIES,
    check_config_dims,
    embedding_spec,
    read_tensor_directory,
)
from ._manifest import (
    BLOCKS_HINT,
    MANIFEST_FILE,
    NVFP4_PARTS,
    basis_key,
    check_manifest,
    dense_key,
    nvfp4_key,
    read_json_manifest,
    shared_key,
    theta_key,
)
from ._safetensors import (
    SafetensorsFiles,
    dtype_from_name,
)
from ._theta_write import family_specs

__all__ = ["ThetaCheckpoint"]


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
        manifest_file, manifest = read_json_manifest(
            path, MANIFEST_FILE, what="a theta checkpoint", error=ThetaFormatError
        )
        manifest = check_manifest(manifest_file, manifest)
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

    def layers_of(self, family: str) -> list[int]:
        """The decoder layers ``family`` covers (all of them unless the family is grouped)."""
        return list(self._entry(family).get("layers", range(self.num_layers)))

    def projection_of(self, family: str) -> str:
        """The projection a family entry stores (``self_attn.q_proj`` for ``...@full_attention``)."""
        return str(self._entry(family).get("family", family))

    def _expected_bands(self, name: str, fam: dict) -> tuple[list[int], int, str | None]:
        """The canonical band map of a banded or shared-basis family, its ``G``, and a problem."""
        L = len(fam.get("layers", range(self.num_layers)))
        recorded = list(fam["bands"])
        top = self.manifest["blocks"]
        grouped = "layers" in fam
        G = (
            int(top)
            if fam["form"] == "banded" and top is not None and not grouped
            else max(recorded) + 1
        )
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
        band_problems: list[str] = []  # banded families: W0 and band maps
        other_problems: list[str] = []  # the other forms, stray keys
        referenced: set[str] = set()
        banded_G: dict[str, int] = {}
        grouped_G: dict[str, tuple[int, int, int]] = {}  # name: (model G, its G, its layers)
        for name, fam in self.families.items():
            form = fam["form"]
            L = len(fam.get("layers", range(self.num_layers)))
            # A quantized W0's keys that are missing or misshapen are a format problem, not bands.
            keys_problems = (
                band_problems if form == "banded" and not fam.get("quant") else other_problems
            )
            problems = band_problems if form == "banded" else other_problems
            bands = None
            if form != "lowrank":
                bands, G, problem = self._expected_bands(name, fam)
                if problem is not None:
                    problems.append(problem)
                    continue
                if form == "banded" and "layers" not in fam:
                    banded_G[name] = G
                elif form == "banded" and fam.get("model_blocks") is not None:
                    model_G = fam["model_blocks"]
                    if not (
                        isinstance(model_G, int)
                        and 1 <= model_G <= self.num_layers
                        and group_blocks(model_G, L, self.num_layers) == G
                    ):
                        problems.append(
                            f"{name}: {G} bands of its {L} layers are not what model_blocks="
                            f"{model_G!r} gives"
                        )
                        continue
                    grouped_G[name] = (model_G, G, L)
                elif form != "banded":
                    at = fam.get("layers", range(L))
                    uneven = [
                        at[i]
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
                layers=fam.get("layers"),
                family=fam.get("family"),
                quant=fam.get("quant"),
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
                keys_problems.append(f"{name} layer {layer}: " + "; ".join(bad_layers[layer]))
        stray = sorted(
            k
            for k in self.tensors.keys()
            if (k.startswith("attnquant.shared.") or ".theta_" in k) and k not in referenced
        )
        if stray and not band_problems and not other_problems:
            other_problems.append(
                f"theta keys the manifest does not describe: {', '.join(stray[:8])}"
            )
        L = self.num_layers
        want_G = None if blocks is None else resolve_blocks(blocks, L)
        if want_G is not None:
            for name, (model_G, G, n) in grouped_G.items():
                want = group_blocks(want_G, n, L)
                if model_G != want_G and want != G:
                    band_problems.insert(
                        0,
                        f"{name}: decomposed with blocks={model_G} ({G} bands of its {n} layers), "
                        f"asked to serve blocks={want_G} ({want} bands): layers "
                        f"{self.layers_of(name)} have no band-compatible W0",
                    )
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

    def quant(self, family: str) -> str | None:
        """How ``family`` stores its ``W0``: ``"nvfp4"`` (format version 4) or ``None``."""
        return self._entry(family).get("quant")

    def shared(self, family: str, band: int) -> np.ndarray:
        """The ``W0`` of one band of a banded family (dequantized, float32, if in NVFP4)."""
        if self._entry(family, "banded").get("quant"):
            return self._dequantized(family, band)[1]
        return self.tensors.get(shared_key(family, band))

    def _dequantized(self, family: str, band: int) -> tuple[NVFP4Tensor, np.ndarray]:
        q = self.nvfp4(family, band)
        W0 = dequantize_nvfp4(q)
        if not np.isfinite(W0).all():
            raise ThetaFormatError(
                f"{self.path}: {nvfp4_key(family, band, 'scale')} holds NaN/Inf scales "
                f"(the NVFP4 W0 of {family} band {band} does not dequantize to finite values)"
            )
        return q, W0

    def nvfp4(self, family: str, band: int) -> NVFP4Tensor:
        """The stored NVFP4 ``W0`` of one band of a family with ``quant="nvfp4"``."""
        if self._entry(family, "banded").get("quant") != "nvfp4":
            raise ThetaFormatError(f"{self.path}: family {family} does not store W0 in NVFP4")
        weight, scale, scale_2 = (
            self.tensors.get(nvfp4_key(family, band, part)) for part in NVFP4_PARTS
        )
        try:
            return NVFP4Tensor(weight=weight, weight_scale=scale, weight_scale_2=scale_2)
        except NVFP4Error as exc:
            raise ThetaFormatError(f"{self.path}: {family} band {band}: {exc}") from exc

    def basis(self, family: str, band: int) -> np.ndarray:
        """The stored basis of one band of a shared-basis family."""
        self._entry(family, "shared_basis")
        return self.tensors.get(basis_key(family, band))

    def layer(self, family: str, layer: int) -> LayerTheta:
        """The stored ``s``, ``U``, ``V`` of one decoder layer of a banded family."""
        self._entry(family, "banded")
        get = self.tensors.get
        projection = self.projection_of(family)
        return LayerTheta(
            s=get(theta_key(self.stack, layer, projection, "s")),
            U=get(theta_key(self.stack, layer, projection, "U")),
            V=get(theta_key(self.stack, layer, projection, "V")),
        )

    def factors(
        self, family: str, layer: int, *, shared: np.ndarray | None = None
    ) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray, np.ndarray]:
        """The identity's parts ``(s, W0, U, V)`` of one decoder layer, in any form.

        ``shared`` is the layer's band tensor (``W0`` or basis) when the caller holds it.
        """
        fam = self._entry(family)
        get = self.tensors.get
        key = partial(theta_key, self.stack, layer, self.projection_of(family))
        form = fam["form"]
        if form == "lowrank":
            return None, None, get(key("U")), get(key("V"))
        band = fam["bands"][self.layers_of(family).index(layer)]
        if form == "banded":
            W0 = shared if shared is not None else self.shared(family, band)
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
        if fam.get("quant"):
            qs, W0s = zip(
                *(self._dequantized(family, b) for b in range(max(fam["bands"]) + 1)), strict=True
            )
            return FamilyTheta(
                name=family,
                shared=W0s,
                bands=tuple(fam["bands"]),
                layers=tuple(self.layer(family, i) for i in self.layers_of(family)),
                nvfp4=qs,
            )
        return FamilyTheta(
            name=family,
            shared=tuple(self.shared(family, b) for b in range(max(fam["bands"]) + 1)),
            bands=tuple(fam["bands"]),
            layers=tuple(self.layer(family, i) for i in self.layers_of(family)),
        )

    def family_theta(self, family: str) -> ThetaFamily:
        """Load one whole family, in whatever form it is stored."""
        fam = self._entry(family)
        layers = self.layers_of(family)
        projection = self.projection_of(family)
        get = self.tensors.get
        if fam["form"] == "banded":
            return self.family(family)
        if fam["form"] == "lowrank":
            return LowRankFamily(
                name=family,
                U=tuple(get(theta_key(self.stack, i, projection, "U")) for i in layers),
                V=tuple(get(theta_key(self.stack, i, projection, "V")) for i in layers),
            )
        part = "U" if fam["side"] == "in" else "V"
        return SharedBasisFamily(
            name=family,
            side=fam["side"],
            bases=tuple(self.basis(family, b) for b in range(max(fam["bands"]) + 1)),
            bands=tuple(fam["bands"]),
            coefs=tuple(get(theta_key(self.stack, i, projection, part)) for i in layers),
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
            projection = self.projection_of(name)
            keys.update(dense_key(self.stack, i, projection) for i in self.layers_of(name))
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
            projection = self.projection_of(name)
            for i, layer in enumerate(self.layers_of(name)):
                if fam["form"] != "lowrank" and fam["bands"][i] != band:
                    band = fam["bands"][i]  # consecutive layers of a band share one tensor
                    if fam["form"] == "banded":
                        held = self.shared(name, band)
                    else:
                        held = self.tensors.get(basis_key(name, band))
                W = reconstruct(*self.factors(name, layer, shared=held)).astype(dtype)
                yield dense_key(self.stack, layer, projection), W
