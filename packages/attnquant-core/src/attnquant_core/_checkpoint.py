"""Hugging Face style checkpoints: directories of safetensors, projection families by key name."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ._errors import CheckpointError
from ._safetensors_io import SafetensorsFiles, TensorSpec, is_float

__all__ = [
    "FAMILIES",
    "Checkpoint",
    "FamilyInfo",
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
    """One projection family of a checkpoint: its layers' keys, shape and dtype."""

    name: str
    stack: str
    keys: tuple[str, ...]
    shape: tuple[int, int]
    dtype: np.dtype

    @property
    def num_layers(self) -> int:
        return len(self.keys)


class Checkpoint:
    """A dense checkpoint opened lazily: headers are read at open, tensors on demand."""

    def __init__(self, path: Path, files: SafetensorsFiles, config: dict | None) -> None:
        self.path = path
        self.tensors = files
        self.config = config
        self.families = _detect_families(path, files)

    @property
    def directory(self) -> Path:
        """The directory holding the checkpoint (the file's parent for a lone file)."""
        return self.path if self.path.is_dir() else self.path.parent

    @property
    def num_layers(self) -> int:
        """Number of decoder layers (every family has the same count)."""
        return next(iter(self.families.values())).num_layers

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
        files = SafetensorsFiles({k: path / v for k, v in weight_map.items()})
    else:
        shards = sorted(path.glob("*.safetensors"))
        if not shards:
            raise CheckpointError(f"{path}: no *.safetensors files in the directory")
        files = SafetensorsFiles.from_files(shards)
    return files, config


def _detect_families(path: Path, files: SafetensorsFiles) -> dict[str, FamilyInfo]:
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
    families: dict[str, FamilyInfo] = {}
    for name in FAMILIES:
        layers = per_family.get(name)
        if layers is None:
            continue
        missing = [i for i in range(num_layers) if i not in layers]
        if missing:
            raise CheckpointError(
                f"{path}: {stack}.{missing[0]}.{name}.weight is missing "
                f"(family {name} has {len(layers)} of {num_layers} layers; missing {missing})"
            )
        keys = tuple(layers[i] for i in range(num_layers))
        first = files.spec(keys[0])
        for key in keys:
            spec = files.spec(key)
            if len(spec.shape) != 2:
                raise CheckpointError(f"{path}: {key} has shape {list(spec.shape)}, expected 2-D")
            if spec.shape != first.shape:
                raise CheckpointError(
                    f"{path}: shape mismatch inside family {name}: {key} is "
                    f"{list(spec.shape)} but {keys[0]} is {list(first.shape)}"
                )
            if not is_float(spec.dtype) or spec.dtype != first.dtype:
                raise CheckpointError(
                    f"{path}: {key} has dtype {spec.dtype}, expected one float dtype "
                    f"across the family ({first.dtype})"
                )
        families[name] = FamilyInfo(name, stack, keys, first.shape, first.dtype)  # type: ignore[arg-type]
    return families
