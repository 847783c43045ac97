"""The theta checkpoint's manifest, ``attnquant.json``: its keys, its entries, its checks.

The theta checkpoint (docs/checkpoint-format.md): a Hugging Face directory plus theta keys and ``attnquant.json``.

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

Version 3 (written only for models whose layers are not one shape, such as Gemma 4 31B)
adds grouped families: a projection whose layers differ in shape is stored as one family per
group of same-shaped layers, named ``<family>@<group>`` (``self_attn.q_proj@full_attention``),
whose entry adds ``"family"`` (the projection, as in its per-layer keys), ``"group"`` and
``"layers"`` (the decoder layers it covers; ``ranks`` and ``bands`` are per entry of
``layers``). Per-layer keys keep the decoder layer's index; shared keys use the entry's name
(``attnquant.shared.self_attn.q_proj@full_attention.0.W0``). A banded grouped family fitted at
a model-wide ``G`` records it as ``"model_blocks"``. A uniform model's checkpoint is written
as version 2, byte for byte as before; readers of version 2 refuse version 3 as newer.

Version 4 (written only for checkpoints with a quantized ``W0``) adds ``"quant": "nvfp4"`` to
a banded family's entry (and ``"stored_bytes"``, what its tensors take): each band's ``W0`` is
stored in NVIDIA Model Optimizer's NVFP4 layout instead of ``attnquant.shared.<family>.<band>.W0``:

* ``attnquant.shared.<family>.<band>.W0_packed`` uint8 ``[out, in/2]``: the 4-bit E2M1 codes,
  the even input of each pair in the low nibble;
* ``attnquant.shared.<family>.<band>.W0_scale`` float8_e4m3fn ``[out, in/16]``: one scale per
  16 consecutive inputs;
* ``attnquant.shared.<family>.<band>.W0_scale_2`` float32 ``[]``: the per-tensor scale;

so ``W0[o, i] = E2M1[code[o, i]] * float(W0_scale[o, i // 16]) * W0_scale_2`` (``in`` a
multiple of 16); ``s``, ``U``, ``V`` are as in version 2, fitted against that dequantized
``W0``. Checkpoints without a quantized family are still written as version 2 or 3, byte for
byte as before; readers of version 3 refuse version 4 as newer.

Version 1 checkpoints (every family banded, one rank) are still read.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .._errors import (
    AttnquantError,
    ThetaFormatError,
)
from .._version import __version__
from ..forms._banded import QUANTS
from ..forms._factored import SIDES
from ..forms._measure import pooled_error
from ..forms._model import FORMS
from ..forms._nvfp4 import BLOCK_SIZE
from ._checkpoint import FAMILIES
from ._safetensors import (
    dtype_name,
)

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "GROUPED_FORMAT_VERSION",
    "MANIFEST_FILE",
    "NVFP4_PARTS",
    "UNIFORM_FORMAT_VERSION",
    "basis_key",
    "check_manifest",
    "dense_key",
    "family_entry",
    "is_theta_checkpoint",
    "nvfp4_bytes",
    "nvfp4_key",
    "read_json_manifest",
    "shared_key",
    "stored_of",
    "theta_key",
    "theta_manifest",
    "write_manifest",
]


FORMAT_NAME = "attnquant-theta"


#: The newest format version this attnquant reads and writes (4: a quantized ``W0``).
FORMAT_VERSION = 4

#: The version written when a family is grouped (layers of more than one shape) and none quantized.
GROUPED_FORMAT_VERSION = 3

#: The version written when no family is grouped (every layer of a family one shape).
UNIFORM_FORMAT_VERSION = 2


MANIFEST_FILE = "attnquant.json"


BLOCKS_HINT = "this almost always means ATTNQUANT_BLOCKS differs between decomposition and serving"


def theta_key(stack: str, layer: int, family: str, part: str) -> str:
    """``model.layers.3.self_attn.q_proj.theta_U`` for ``part`` in ``s``, ``U``, ``V``."""
    return f"{stack}.{layer}.{family}.theta_{part}"


def shared_key(family: str, band: int) -> str:
    """``attnquant.shared.self_attn.q_proj.0.W0``."""
    return f"attnquant.shared.{family}.{band}.W0"


#: The tensors of an NVFP4 ``W0``, by the suffix of their key (``...W0_packed``).
NVFP4_PARTS: tuple[str, ...] = ("packed", "scale", "scale_2")


def nvfp4_key(family: str, band: int, part: str) -> str:
    """``attnquant.shared.self_attn.q_proj.0.W0_packed`` for ``part`` in :data:`NVFP4_PARTS`."""
    return f"attnquant.shared.{family}.{band}.W0_{part}"


def nvfp4_bytes(shape: Sequence[int]) -> int:
    """Bytes of one NVFP4 ``W0`` ``[out, in]``: 4 bits a weight, one E4M3 per 16, the global scale."""
    out_dim, in_dim = (int(d) for d in shape)
    return out_dim * in_dim // 2 + out_dim * (in_dim // BLOCK_SIZE) + 4


def basis_key(family: str, band: int) -> str:
    """``attnquant.shared.self_attn.q_proj.0.basis`` (shared-basis form)."""
    return f"attnquant.shared.{family}.{band}.basis"


def dense_key(stack: str, layer: int, family: str) -> str:
    return f"{stack}.{layer}.{family}.weight"


def is_theta_checkpoint(path: str | Path) -> bool:
    """True when ``path`` is a directory holding an ``attnquant.json``."""
    return (Path(path) / MANIFEST_FILE).is_file()


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


def theta_manifest(
    *,
    num_layers: int,
    stack: str,
    families: Mapping[str, dict],
    svd: Mapping[str, object] | None,
    source: dict | None,
    aligned: Mapping[str, object] | None = None,
    **extra: object,
) -> dict:
    """The ``attnquant.json`` manifest of a theta checkpoint holding ``families``.

    ``svd`` is the truncated SVD's settings (:meth:`SVDOptions.to_json`), ``aligned`` the record
    of a fit to an aligned copy (written last, after ``source``).
    """
    banded = [f for f in families.values() if f["form"] == "banded"]
    # A grouped family counts with the model-wide G it was fitted at (None: chosen per group).
    Gs = {f.get("model_blocks") if "layers" in f else max(f["bands"]) + 1 for f in banded}
    blocks = Gs.pop() if len(Gs) == 1 else None
    grouped = any("layers" in f for f in families.values())
    quantized = any(f.get("quant") for f in families.values())
    version = (
        FORMAT_VERSION
        if quantized
        else GROUPED_FORMAT_VERSION
        if grouped
        else UNIFORM_FORMAT_VERSION
    )
    manifest = {
        "format": FORMAT_NAME,
        "format_version": version,
        "writer": f"attnquant-core {__version__}",
        # The G every banded family shares (what ATTNQUANT_BLOCKS is checked against); null
        # when no family is banded or they disagree.
        "blocks": blocks,
        "num_layers": num_layers,
        "passthrough": len(banded) == len(families) and blocks == num_layers,
        "rank": max(f["rank"] for f in families.values()),
        "stack": stack,
        "forms": sorted({f["form"] for f in families.values()}),
        "svd": dict(svd) if svd else None,
        **extra,
        "families": dict(families),
        "source": source or {},
    }
    if aligned is not None:
        manifest["aligned"] = dict(aligned)
    return manifest


def write_manifest(directory: Path, manifest: Mapping) -> None:
    """Write ``manifest`` as ``directory/attnquant.json``."""
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")


def read_json_manifest(
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


def check_manifest(where: Path, m: object) -> dict:
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
        quant = fam.get("quant")
        if quant is not None:
            if version < FORMAT_VERSION:
                raise ThetaFormatError(
                    f"{where}: family {name} has 'quant', which format version {version} "
                    f"does not have"
                )
            if quant not in QUANTS or form != "banded":
                raise ThetaFormatError(
                    f"{where}: family {name} ({form}) has quant {quant!r}; this attnquant reads "
                    f"{', '.join(map(repr, QUANTS))} on banded families only"
                )
            if fam["shape"][1] % BLOCK_SIZE:
                raise ThetaFormatError(
                    f"{where}: family {name} has quant {quant!r} with in={fam['shape'][1]}, "
                    f"which is not a multiple of {BLOCK_SIZE}"
                )
        n = L
        if "layers" in fam:  # a grouped family (version 3)
            if version < 3:
                raise ThetaFormatError(
                    f"{where}: family {name} lists 'layers', which format version {version} "
                    f"does not have"
                )
            layers = fam["layers"]
            n = len(layers) if isinstance(layers, list) else 0
            layers = _int_list(where, name, "layers", layers, n)
            if not n or layers != sorted(set(layers)) or layers[-1] >= L:
                raise ThetaFormatError(
                    f"{where}: family {name} has layers={layers!r}; expected increasing decoder "
                    f"layers within 0..{L - 1}"
                )
            if not isinstance(fam.get("family"), str) or fam["family"] not in FAMILIES:
                raise ThetaFormatError(
                    f"{where}: grouped family {name} names projection {fam.get('family')!r}"
                )
            fam["layers"] = layers
        if version == 1:
            fam["ranks"] = [fam["rank"]] * L
        fam["ranks"] = _int_list(where, name, "ranks", fam["ranks"], n)
        fam["rank"] = max(fam["ranks"])
        if form == "lowrank":
            fam["bands"], fam["side"] = None, None
        else:
            if not fam.get("bands"):
                raise ThetaFormatError(f"{where}: family {name} ({form}) has no 'bands'")
            fam["bands"] = _int_list(where, name, "bands", fam["bands"], n)
            fam["blocks"] = max(fam["bands"]) + 1
            side = fam.get("side")
            if form == "shared_basis" and side not in SIDES:
                raise ThetaFormatError(
                    f"{where}: family {name} (shared_basis) has side {side!r}; "
                    f"expected one of {', '.join(SIDES)}"
                )
            fam["side"] = side if form == "shared_basis" else None
        families[name] = fam
    covered: dict[str, list[int]] = {}
    for name, fam in families.items():
        layers = fam.get("layers", range(L))
        seen = covered.setdefault(fam.get("family", name), [])
        if set(seen) & set(layers):
            raise ThetaFormatError(
                f"{where}: family {name} covers layers another entry of "
                f"{fam.get('family', name)} covers too"
            )
        seen.extend(layers)
    m["families"] = families
    return m
