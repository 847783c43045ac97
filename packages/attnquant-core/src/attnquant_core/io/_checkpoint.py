"""Hugging Face style checkpoints: directories of safetensors, projection families by key name."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .._errors import CheckpointError
from ._safetensors import DIGESTS_FILE, SafetensorsFiles, TensorSpec, is_float, read_digests

__all__ = [
    "FAMILIES",
    "Checkpoint",
    "FamilyInfo",
    "check_config_dims",
    "INDEX_FILE",
    "open_checkpoint",
    "parse_projection_key",
]

#: The projections that repeat in every decoder layer, in the order they are processed.
FAMILIES: tuple[str, ...] = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
INDEX_FILE = "model.safetensors.index.json"

_KEY = re.compile(
    r"^(?P<stack>(?:.+\.)?layers)\.(?P<layer>\d+)\."
    r"(?P<family>self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)\.weight$"
)
# Layer stacks that are not the decoder (vision or audio towers of multimodal checkpoints).
_NOT_DECODER = re.compile(r"(vision|audio|encoder|visual|image)", re.IGNORECASE)


def parse_projection_key(key: str) -> tuple[str, int, str] | None:
    """Split ``model.layers.3.self_attn.q_proj.weight`` into ``("model.layers", 3, "self_attn.q_proj")``."""
    m = _KEY.match(key)
    if m is None:
        return None
    return m["stack"], int(m["layer"]), m["family"]


@dataclass(frozen=True)
class FamilyInfo:
    """One projection family of a checkpoint: its layers' keys, shape and dtype.

    In a model whose layers are not all one shape (Gemma 4 31B: global layers with their own
    head size and no ``v_proj``), a family is split into groups of same-shaped layers; each
    group is a family of its own, named ``<family>@<group>`` (``group`` is the layers'
    ``layer_types`` entry, or ``<out>x<in>``), ``family`` is the projection (the key name) and
    ``layers`` the decoder layers it covers. A uniform family has ``group`` None, ``family``
    equal to ``name`` and ``layers`` ``0 .. L-1``.
    """

    name: str
    stack: str
    keys: tuple[str, ...]
    shape: tuple[int, int]
    dtype: np.dtype
    family: str = ""
    layers: tuple[int, ...] = ()
    group: str | None = None

    def __post_init__(self) -> None:
        if not self.family:
            object.__setattr__(self, "family", self.name)
        if not self.layers:
            object.__setattr__(self, "layers", tuple(range(len(self.keys))))

    @property
    def num_layers(self) -> int:
        """Number of layers of this family (of its group, for a grouped family)."""
        return len(self.keys)


class Checkpoint:
    """A dense checkpoint opened lazily: headers are read at open, tensors on demand."""

    def __init__(self, path: Path, files: SafetensorsFiles, config: dict | None) -> None:
        self.path = path
        self.tensors = files
        self.config = config
        self.families = detect_families(path, files, config)
        if config is not None:
            check_config_dims(
                self.directory / "config.json",
                config,
                num_layers=self.num_layers,
                projections={
                    f.family: (f.keys[0], f.shape)
                    for f in self.families.values()
                    if f.group in (None, "sliding_attention")  # global layers: their own dims
                },
                embedding=embedding_spec(files, self.stack),
            )

    @property
    def directory(self) -> Path:
        """The directory holding the checkpoint (the file's parent for a lone file)."""
        return self.path if self.path.is_dir() else self.path.parent

    @property
    def num_layers(self) -> int:
        """Number of decoder layers (a grouped family covers some of them)."""
        return max(max(f.layers) for f in self.families.values()) + 1

    @property
    def grouped(self) -> bool:
        """Whether some family is split into groups of same-shaped layers (Gemma 4 31B)."""
        return any(f.group is not None for f in self.families.values())

    @property
    def stack(self) -> str:
        """The key prefix of the decoder layers, e.g. ``model.layers``."""
        return next(iter(self.families.values())).stack

    def keys(self) -> list[str]:
        """Every tensor key, sorted."""
        return self.tensors.keys()

    def spec(self, key: str) -> TensorSpec:
        """Dtype and shape of one tensor without reading it."""
        return self.tensors.spec(key)

    def get(self, key: str, *, check_finite: bool = False) -> np.ndarray:
        """Read one tensor in its stored dtype; ``check_finite`` refuses NaN/Inf naming the key."""
        array = self.tensors.get(key)
        if check_finite and is_float(array.dtype) and not np.isfinite(array).all():
            bad = int(np.size(array) - np.count_nonzero(np.isfinite(array)))
            raise CheckpointError(
                f"{self.tensors.file_of(key)}: {key} holds {bad} NaN/Inf values; "
                f"refusing to decompose a non-finite weight"
            )
        return array

    def projection_keys(self) -> set[str]:
        """Keys of every projection weight that is decomposed."""
        return {k for info in self.families.values() for k in info.keys}


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Open a Hugging Face checkpoint: a directory (single file or sharded with an index) or one file."""
    path = Path(path)
    files, config = read_tensor_directory(path)
    return Checkpoint(path, files, config)


def read_tensor_directory(path: Path) -> tuple[SafetensorsFiles, dict | None]:
    """The tensors (headers only) and ``config.json`` of a checkpoint directory or file."""
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint")
    if path.is_file():
        if path.suffix != ".safetensors":
            raise CheckpointError(f"{path}: expected a directory or a .safetensors file")
        return SafetensorsFiles.from_files([path]), None
    digests = {"digests": read_digests(path), "digests_file": path / DIGESTS_FILE}
    config = None
    config_file = path / "config.json"
    if config_file.exists():
        try:
            config = json.loads(config_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{config_file}: not valid JSON ({exc})") from exc
    index_file = path / INDEX_FILE
    if index_file.exists():
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index_file}: no valid weight_map ({exc})") from exc
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index_file}: weight_map is not an object")
        files = SafetensorsFiles(
            {k: _shard_path(path, index_file, k, v) for k, v in weight_map.items()}, **digests
        )
    else:
        shards = sorted(path.glob("*.safetensors"))
        if not shards:
            raise CheckpointError(f"{path}: no *.safetensors files in the directory")
        files = SafetensorsFiles.from_files(shards, **digests)
    return files, config


def _shard_path(directory: Path, index_file: Path, key: str, name: object) -> Path:
    """The shard the index names for ``key``, refused unless it lies inside ``directory``.

    The name must be a relative path without ``..`` whose folders, links resolved, stay inside
    the checkpoint directory. The shard file itself may be a symbolic link (the Hugging Face
    cache links each snapshot file to a blob outside the snapshot folder).
    """
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"{index_file}: shard of {key!r} is {name!r}, not a file name")
    parts = Path(name).parts
    if Path(name).is_absolute() or ".." in parts or "\\" in name:
        raise CheckpointError(
            f"{index_file}: shard {name!r} of {key!r} is outside the checkpoint directory"
        )
    shard = directory / name
    root = directory.resolve()
    parent = shard.parent.resolve()
    if parent != root and root not in parent.parents:
        raise CheckpointError(
            f"{index_file}: shard {name!r} of {key!r} resolves to {parent / shard.name}, "
            f"outside the checkpoint directory {root}"
        )
    return shard


def _text_config(config: dict | None) -> dict:
    if not isinstance(config, dict):
        return {}
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def layer_types_of(config: dict | None, num_layers: int) -> list[str] | None:
    """``layer_types`` of a model whose layers differ in shape (Gemma 4 31B), else None.

    Layers may differ when the config says so: global layers with their own head size
    (``global_head_dim``) or no ``v_proj`` (``attention_k_eq_v``).
    """
    text = _text_config(config)
    types = text.get("layer_types")
    mixed = bool(text.get("attention_k_eq_v")) or text.get("global_head_dim") not in (
        None,
        text.get("head_dim"),
    )
    if not mixed or not isinstance(types, list) or len(types) != num_layers:
        return None
    if not all(isinstance(t, str) for t in types):
        return None
    return types


def _groups(
    name: str,
    layers: dict[int, str],
    shapes: dict[int, tuple[int, ...]],
    num_layers: int,
    layer_types: list[str] | None,
) -> list[tuple[str | None, list[int]]] | None:
    """The groups of same-shaped layers of one family: ``[(group, layers)]``, or None when the
    family cannot be grouped (then the caller refuses it as before).

    One group named None when every layer is present and one shape (a uniform family). Else,
    only where ``layer_types`` explains it: each shape's layers form a group named by their
    layer type (or ``<out>x<in>`` when several types share the shape), and missing layers must
    be ``v_proj`` of global layers under ``attention_k_eq_v``.
    """
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for i in sorted(layers):
        by_shape.setdefault(shapes[i], []).append(i)
    missing = [i for i in range(num_layers) if i not in layers]
    if not missing and len(by_shape) == 1:
        return [(None, sorted(layers))]
    if layer_types is None:
        return None
    if missing and not (
        name == "self_attn.v_proj" and all(layer_types[i] == "full_attention" for i in missing)
    ):
        return None
    groups: list[tuple[str | None, list[int]]] = []
    for shape, members in by_shape.items():
        types = {layer_types[i] for i in members}
        label = types.pop() if len(types) == 1 else "x".join(str(d) for d in shape)
        groups.append((label, members))
    if len({g for g, _ in groups}) != len(groups):
        return None
    return sorted(groups, key=lambda g: g[1][0])


def _layer_type_hint(path: Path, config: dict | None = None) -> str:
    """Why a family may differ between layers: Gemma 4's global layers (from ``config.json``)."""
    text = _text_config(config)
    if not text:
        return ""
    mixed = bool(text.get("attention_k_eq_v")) or text.get("global_head_dim") not in (
        None,
        text.get("head_dim"),
    )
    if not mixed:
        return ""
    return (
        ". Its global layers (layer_types 'full_attention') may have their own head size "
        "and no v_proj (Gemma 4 31B), but config.json's layer_types does not explain this "
        "layer's shape or absence"
    )


def detect_families(
    path: Path, files: SafetensorsFiles, config: dict | None = None
) -> dict[str, FamilyInfo]:
    """The projection families of a checkpoint, by key name, grouped by shape where the
    config's ``layer_types`` explain layers of different shapes (see :class:`FamilyInfo`)."""
    found: dict[str, dict[str, dict[int, str]]] = defaultdict(lambda: defaultdict(dict))
    for key in files.keys():
        parsed = parse_projection_key(key)
        if parsed is not None:
            stack, layer, family = parsed
            found[stack][family][layer] = key
    if not found:
        raise CheckpointError(
            f"{path}: no decoder projections found (looked for keys such as "
            f"'model.layers.0.self_attn.q_proj.weight'); unknown architecture"
        )
    stacks = sorted(found)
    if len(stacks) > 1:
        stacks = [s for s in stacks if not _NOT_DECODER.search(s)] or stacks
    if len(stacks) > 1:
        raise CheckpointError(f"{path}: several decoder layer stacks found: {', '.join(stacks)}")
    stack = stacks[0]
    per_family = found[stack]
    num_layers = max(max(layers) for layers in per_family.values()) + 1
    layer_types = layer_types_of(config, num_layers)
    families: dict[str, FamilyInfo] = {}
    for name in FAMILIES:
        layers = per_family.get(name)
        if layers is None:
            continue
        shapes: dict[int, tuple[int, ...]] = {}
        first_key = layers[min(layers)]
        first = files.spec(first_key)
        for i, key in sorted(layers.items()):
            spec = files.spec(key)
            if len(spec.shape) != 2:
                raise CheckpointError(f"{path}: {key} has shape {list(spec.shape)}, expected 2-D")
            if not is_float(spec.dtype) or spec.dtype != first.dtype:
                raise CheckpointError(
                    f"{path}: {key} has dtype {spec.dtype}, expected one float dtype "
                    f"across the family ({first.dtype})"
                )
            shapes[i] = spec.shape
        groups = _groups(name, layers, shapes, num_layers, layer_types)
        if groups is None:
            missing = [i for i in range(num_layers) if i not in layers]
            if missing:
                raise CheckpointError(
                    f"{path}: {stack}.{missing[0]}.{name}.weight is missing "
                    f"(family {name} has {len(layers)} of {num_layers} layers; missing {missing})"
                    + _layer_type_hint(path, config)
                )
            key = next(k for i, k in sorted(layers.items()) if shapes[i] != first.shape)
            raise CheckpointError(
                f"{path}: shape mismatch inside family {name}: {key} is "
                f"{list(files.spec(key).shape)} but {first_key} is {list(first.shape)}"
                + _layer_type_hint(path, config)
            )
        for group, members in groups:
            entry = name if group is None else f"{name}@{group}"
            shape = shapes[members[0]]
            families[entry] = FamilyInfo(
                entry,
                stack,
                tuple(layers[i] for i in members),
                shape,  # type: ignore[arg-type]
                first.dtype,
                family=name,
                layers=tuple(members),
                group=group,
            )
    return families


# What each family's [out, in] shape must be, in config.json's terms.
_FAMILY_DIMS: dict[str, tuple[str, str]] = {
    "self_attn.q_proj": ("num_attention_heads*head_dim", "hidden_size"),
    "self_attn.k_proj": ("num_key_value_heads*head_dim", "hidden_size"),
    "self_attn.v_proj": ("num_key_value_heads*head_dim", "hidden_size"),
    "self_attn.o_proj": ("hidden_size", "num_attention_heads*head_dim"),
    "mlp.gate_proj": ("intermediate_size", "hidden_size"),
    "mlp.up_proj": ("intermediate_size", "hidden_size"),
    "mlp.down_proj": ("hidden_size", "intermediate_size"),
}


def embedding_spec(files: SafetensorsFiles, stack: str) -> tuple[str, tuple[int, ...]] | None:
    """The decoder's token embedding (key, shape) beside the layer ``stack``, if stored."""
    key = f"{stack.removesuffix('layers')}embed_tokens.weight"
    return (key, files.spec(key).shape) if key in files else None


def check_config_dims(
    config_file: Path,
    config: dict,
    *,
    num_layers: int,
    projections: dict[str, tuple[str, tuple[int, int]]],
    embedding: tuple[str, tuple[int, ...]] | None,
) -> None:
    """Refuse a ``config.json`` whose dimensions disagree with the tensors beside it.

    Checks, where the config states them: ``num_hidden_layers`` against the layers stored,
    ``hidden_size``, ``intermediate_size``, heads x ``head_dim`` against each projection family's
    ``[out, in]`` (``projections``: family -> (first key, shape)) and ``vocab_size`` x
    ``hidden_size`` against the token embedding. A multimodal config's ``text_config`` is the
    one checked. Raises a one-line :class:`CheckpointError` naming the field and the key.
    """
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_file}: not a JSON object")
    text = config.get("text_config")
    cfg = text if isinstance(text, dict) else config
    fields = (
        "num_hidden_layers",
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
    )
    dims: dict[str, int] = {}
    for field in fields:
        value = cfg.get(field)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CheckpointError(f"{config_file}: {field} is {value!r}, not a positive integer")
        dims[field] = value
    layers = dims.get("num_hidden_layers")
    if layers is not None and layers != num_layers:
        raise CheckpointError(
            f"{config_file}: num_hidden_layers is {layers} but the tensors hold {num_layers} "
            f"decoder layers"
        )
    if "num_attention_heads" in dims:
        dims.setdefault("num_key_value_heads", dims["num_attention_heads"])
        if "head_dim" not in dims and "hidden_size" in dims:
            dims["head_dim"] = dims["hidden_size"] // dims["num_attention_heads"]
    for a, b in (("num_attention_heads", "head_dim"), ("num_key_value_heads", "head_dim")):
        if a in dims and b in dims:
            dims[f"{a}*{b}"] = dims[a] * dims[b]
    for family, (key, shape) in projections.items():
        for axis, term in zip(("out", "in"), _FAMILY_DIMS[family], strict=True):
            want = dims.get(term)
            have = shape[0] if axis == "out" else shape[1]
            if want is not None and want != have:
                raise CheckpointError(
                    f"{config_file}: {term.replace('*', ' x ')} is {want} but {key} has "
                    f"shape {list(shape)} ({axis} dimension {have})"
                )
    if embedding is not None:
        key, shape = embedding
        for term, have in zip(("vocab_size", "hidden_size"), shape, strict=False):
            want = dims.get(term)
            if want is not None and want != have:
                raise CheckpointError(
                    f"{config_file}: {term} is {want} but {key} has shape {list(shape)}"
                )
