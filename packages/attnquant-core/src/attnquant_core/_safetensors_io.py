"""Safetensors plumbing: lazy reads through the ``safetensors`` library, planned streaming writes.

``safetensors.numpy.save_file`` needs every tensor in memory at once. A decomposition streams
layer by layer, but it knows every output shape up front, so it plans the files (header and
offsets) first and then writes each tensor in place as soon as it is computed: peak memory
follows the largest tensor, not the checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from ._errors import CheckpointError

__all__ = [
    "PlannedWriter",
    "SafetensorsFiles",
    "TensorSpec",
    "dtype_from_name",
    "dtype_name",
    "is_float",
]

_NAME_TO_DTYPE: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_DTYPE_TO_NAME = {v: k for k, v in _NAME_TO_DTYPE.items()}


def is_float(dtype: np.dtype | type) -> bool:
    """True for numpy floats and the ml_dtypes floats (bfloat16, float8), whose kind is not 'f'."""
    dtype = np.dtype(dtype)
    return dtype.kind == "f" or dtype in (
        _NAME_TO_DTYPE["BF16"],
        _NAME_TO_DTYPE["F8_E4M3"],
        _NAME_TO_DTYPE["F8_E5M2"],
    )


def dtype_name(dtype: np.dtype | type) -> str:
    """The safetensors name of a numpy dtype (``float32 -> "F32"``, ``bfloat16 -> "BF16"``)."""
    try:
        return _DTYPE_TO_NAME[np.dtype(dtype)]
    except KeyError:
        raise CheckpointError(f"dtype {np.dtype(dtype)} cannot be stored in safetensors") from None


def dtype_from_name(name: str) -> np.dtype:
    """The numpy dtype of a safetensors dtype name."""
    try:
        return _NAME_TO_DTYPE[name]
    except KeyError:
        raise CheckpointError(f"unsupported safetensors dtype {name!r}") from None


@dataclass(frozen=True)
class TensorSpec:
    """Dtype and shape of one tensor, known before its data."""

    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


class SafetensorsFiles:
    """Read-only view of one or more safetensors files: headers at open, data on demand.

    Each file is validated once by the ``safetensors`` library (header, offsets, coverage), then
    closed. :meth:`get` maps just the tensor's byte range, copies it out and unmaps it at once,
    so the resident size of a long streamed read stays at one tensor, not at the files touched.
    """

    def __init__(self, key_to_file: Mapping[str, Path]) -> None:
        self._key_to_file = dict(key_to_file)
        self._specs: dict[str, TensorSpec] = {}
        self._offsets: dict[str, int] = {}
        for path in sorted(set(self._key_to_file.values())):
            with _open(path):  # validation only: raises a CheckpointError naming the file
                pass
            header, data_start = _read_header(path)
            for key, entry in header.items():
                if key == "__metadata__" or self._key_to_file.get(key, path) != path:
                    continue
                begin, _ = entry["data_offsets"]
                self._specs[key] = TensorSpec(
                    dtype_from_name(entry["dtype"]), tuple(entry["shape"])
                )
                self._offsets[key] = data_start + begin
        missing = sorted(set(self._key_to_file) - set(self._specs))
        if missing:
            raise CheckpointError(
                f"{self._key_to_file[missing[0]]}: key {missing[0]!r} is listed in the index "
                f"but not stored in the file ({len(missing)} such keys)"
            )

    @classmethod
    def from_files(cls, files: Iterable[Path]) -> SafetensorsFiles:
        """Open whole files; a key stored in two files is an error."""
        key_to_file: dict[str, Path] = {}
        for path in files:
            with _open(path) as handle:
                for key in handle.keys():
                    if key in key_to_file:
                        raise CheckpointError(
                            f"key {key!r} is stored twice: in {key_to_file[key]} and in {path}"
                        )
                    key_to_file[key] = path
        return cls(key_to_file)

    def keys(self) -> list[str]:
        """Every tensor key, in sorted order."""
        return sorted(self._specs)

    def __contains__(self, key: object) -> bool:
        return key in self._specs

    def spec(self, key: str) -> TensorSpec:
        """Dtype and shape of ``key`` without reading its data."""
        try:
            return self._specs[key]
        except KeyError:
            raise CheckpointError(f"no tensor {key!r} in the checkpoint") from None

    def file_of(self, key: str) -> Path:
        """The file that stores ``key``."""
        return self._key_to_file[key]

    def get(self, key: str) -> np.ndarray:
        """Read one tensor into a fresh array in its stored dtype (memory-mapped, then unmapped)."""
        spec = self.spec(key)
        path = self._key_to_file[key]
        if spec.nbytes == 0:
            return np.zeros(spec.shape, spec.dtype)
        offset = self._offsets[key]
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        try:
            with (
                open(path, "rb") as f,
                mmap.mmap(
                    f.fileno(), offset + spec.nbytes - start, offset=start, access=mmap.ACCESS_READ
                ) as mapped,
            ):
                view = np.frombuffer(
                    mapped,
                    spec.dtype,
                    count=spec.nbytes // spec.dtype.itemsize,
                    offset=offset - start,
                )
                array = view.reshape(spec.shape).copy()
                del view  # release the buffer so the mapping can close now
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{path}: cannot read {key!r}: {exc}") from exc
        return array


def _read_header(path: Path) -> tuple[dict, int]:
    """The JSON header of a (validated) safetensors file and where its data section starts."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(size)), 8 + size


def _open(path: Path):
    """``safe_open`` whose errors name the file."""
    if not Path(path).is_file():
        raise CheckpointError(f"{path}: safetensors file is missing")
    try:
        return safe_open(str(path), framework="numpy")
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from exc


class PlannedWriter:
    """Write safetensors shards whose layout is fixed up front; tensors arrive in any order.

    ``specs`` maps key -> :class:`TensorSpec`. Keys are packed, in the given order, into shards of
    at most ``max_shard_bytes`` (a single larger tensor gets a shard of its own). Files are named
    ``model.safetensors`` when one shard suffices, else ``model-0000i-of-0000n.safetensors`` with a
    ``model.safetensors.index.json``. :meth:`close` fails if any planned tensor was not written.
    """

    def __init__(
        self,
        directory: Path,
        specs: Mapping[str, TensorSpec],
        *,
        max_shard_bytes: int = 2 << 30,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        self.directory = Path(directory)
        shards: list[list[str]] = [[]]
        size = 0
        for key, spec in specs.items():
            if shards[-1] and size + spec.nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(key)
            size += spec.nbytes
        n = len(shards)
        names = (
            ["model.safetensors"]
            if n == 1
            else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        )
        self._specs = dict(specs)
        self._where: dict[str, tuple[int, int]] = {}  # key -> (fd, absolute offset)
        self._fds: list[int] = []
        self._pending = set(self._specs)
        self._weight_map: dict[str, str] = {}
        self._total = 0
        for name, keys in zip(names, shards, strict=True):
            header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
            offset = 0
            for key in keys:
                spec = self._specs[key]
                header[key] = {
                    "dtype": dtype_name(spec.dtype),
                    "shape": list(spec.shape),
                    "data_offsets": [offset, offset + spec.nbytes],
                }
                offset += spec.nbytes
                self._weight_map[key] = name
            blob = json.dumps(header, separators=(",", ":")).encode()
            blob += b" " * (-(len(blob) + 8) % 8)  # data section 8-byte aligned, as upstream does
            start = 8 + len(blob)
            fd = os.open(self.directory / name, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            self._fds.append(fd)
            os.pwrite(fd, len(blob).to_bytes(8, "little") + blob, 0)
            os.ftruncate(fd, start + offset)
            data_offset = 0
            for key in keys:
                self._where[key] = (fd, start + data_offset)
                data_offset += self._specs[key].nbytes
            self._total += offset
        self.files = names

    @property
    def total_bytes(self) -> int:
        """Bytes of tensor data planned across all shards."""
        return self._total

    def write(self, key: str, array: np.ndarray) -> None:
        """Write ``array`` at ``key``'s planned place; dtype and shape must match the plan."""
        spec = self._specs.get(key)
        if spec is None:
            raise KeyError(f"{key!r} was not planned")
        if key not in self._pending:
            raise KeyError(f"{key!r} was already written")
        if array.dtype != spec.dtype or tuple(array.shape) != spec.shape:
            raise ValueError(
                f"{key!r}: planned {spec.dtype}{list(spec.shape)}, got {array.dtype}{list(array.shape)}"
            )
        fd, offset = self._where[key]
        data = memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
        while data.nbytes:
            written = os.pwrite(fd, data, offset)
            data, offset = data[written:], offset + written
        self._pending.discard(key)

    def __enter__(self) -> PlannedWriter:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        """Close on success; on failure close quietly and let the first error through."""
        if exc_type is None:
            self.close()
            return
        with contextlib.suppress(Exception):
            self.close()

    def close(self) -> None:
        """Flush and close every shard; write the index when there are several."""
        try:
            if self._pending:
                missing = sorted(self._pending)
                raise RuntimeError(
                    f"{len(missing)} planned tensors never written, e.g. {missing[0]}"
                )
            for fd in self._fds:
                os.fsync(fd)
        finally:
            for fd in self._fds:
                os.close(fd)
            self._fds = []
        if len(self.files) > 1:
            index = {"metadata": {"total_size": self._total}, "weight_map": self._weight_map}
            (self.directory / "model.safetensors.index.json").write_text(
                json.dumps(index, indent=2)
            )
