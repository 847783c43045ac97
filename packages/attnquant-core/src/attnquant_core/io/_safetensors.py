"""Safetensors plumbing: lazy reads through the ``safetensors`` library, planned streaming writes.

``safetensors.numpy.save_file`` needs every tensor in memory at once. A decomposition streams
layer by layer, but it knows every output shape up front, so it plans the files (header and
offsets) first and then writes each tensor in place as soon as it is computed: peak memory
follows the largest tensor, not the checkpoint.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from .._errors import CheckpointError, IntegrityError

__all__ = [
    "DIGESTS_FILE",
    "DIGEST_ALGORITHM",
    "PlannedWriter",
    "SafetensorsFiles",
    "TensorSpec",
    "dtype_from_name",
    "dtype_name",
    "is_float",
    "read_digests",
    "tensor_digest",
    "verify_by_default",
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

#: Written by :class:`PlannedWriter` beside the shards: the digest of every tensor's raw bytes.
DIGESTS_FILE = "attnquant.digests.json"
#: sha256: with the CPU's SHA extensions the fastest of hashlib's digests here (0.7 GB/s, twice
#: blake2b's), and stable across Python versions.
DIGEST_ALGORITHM = "sha256"
_DIGESTS_FORMAT = "attnquant-digests"
#: ``ATTNQUANT_VERIFY_DIGESTS=0`` turns the check of each tensor read off.
VERIFY_ENV = "ATTNQUANT_VERIFY_DIGESTS"


def verify_by_default() -> bool:
    """Whether reads check recorded digests: yes unless ``ATTNQUANT_VERIFY_DIGESTS=0``."""
    value = os.environ.get(VERIFY_ENV, "1").strip().lower()
    if value in ("1", "true", "yes", "on", ""):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise CheckpointError(f"{VERIFY_ENV}={value!r}: expected 1 or 0")


def tensor_digest(data: object) -> str:
    """The hex digest of a tensor's raw bytes (any buffer: array, memoryview, mmap slice)."""
    return hashlib.new(DIGEST_ALGORITHM, memoryview(data).cast("B")).hexdigest()  # type: ignore[arg-type]


def read_digests(directory: Path) -> dict[str, str] | None:
    """The recorded tensor digests of a checkpoint directory; ``None`` when it records none
    (checkpoints written before attnquant 0.3 and by other tools)."""
    path = Path(directory) / DIGESTS_FILE
    if not path.is_file():
        return None
    try:
        blob = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise IntegrityError(f"{path}: not valid JSON ({exc})") from exc
    if (
        not isinstance(blob, dict)
        or blob.get("format") != _DIGESTS_FORMAT
        or blob.get("algorithm") != DIGEST_ALGORITHM
        or not isinstance(blob.get("tensors"), dict)
    ):
        raise IntegrityError(
            f"{path}: not an {_DIGESTS_FORMAT} file with {DIGEST_ALGORITHM} tensor digests"
        )
    return {str(k): str(v) for k, v in blob["tensors"].items()}


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

    ``digests`` (key -> hex digest, from :data:`DIGESTS_FILE`), when given, are checked on every
    :meth:`get` unless ``verify`` is false (default: :func:`verify_by_default`); a tensor whose
    bytes differ, or that has no recorded digest, raises :class:`IntegrityError`.
    """

    def __init__(
        self,
        key_to_file: Mapping[str, Path],
        *,
        digests: Mapping[str, str] | None = None,
        digests_file: Path | None = None,
        verify: bool | None = None,
    ) -> None:
        self._key_to_file = dict(key_to_file)
        self.digests = dict(digests) if digests is not None else None
        self.digests_file = digests_file
        self.verify = verify_by_default() if verify is None else verify
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
    def from_files(cls, files: Iterable[Path], **digests: object) -> SafetensorsFiles:
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
        return cls(key_to_file, **digests)  # type: ignore[arg-type]

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
        if self.verify and self.digests is not None:
            self._check(key, tensor_digest(array.reshape(-1).view(np.uint8)))
        return array

    def check(self, key: str) -> None:
        """Verify one tensor's bytes against its recorded digest without copying it out."""
        spec = self.spec(key)
        path = self._key_to_file[key]
        digest = hashlib.new(DIGEST_ALGORITHM)
        offset, end = self._offsets[key], self._offsets[key] + spec.nbytes
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                chunk = bytearray(min(16 << 20, max(spec.nbytes, 1)))
                while offset < end:
                    n = f.readinto(memoryview(chunk)[: min(len(chunk), end - offset)])
                    if not n:
                        raise OSError("file ends before the tensor does")
                    digest.update(memoryview(chunk)[:n])
                    offset += n
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot read {key!r}: {exc}") from exc
        self._check(key, digest.hexdigest())

    def _check(self, key: str, digest: str) -> None:
        assert self.digests is not None
        path = self._key_to_file[key]
        want = self.digests.get(key)
        if want is None:
            raise IntegrityError(
                f"{path}: tensor {key!r} has no digest in {self.digests_file or DIGESTS_FILE}; "
                f"the checkpoint was changed after it was written"
            )
        if digest != want:
            raise IntegrityError(
                f"{path}: tensor {key!r} does not match its recorded {DIGEST_ALGORITHM} digest "
                f"(corrupt or changed since written); set {VERIFY_ENV}=0 to load it anyway"
            )


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
        self.digests: dict[str, str] = {}
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
        self.digests[key] = tensor_digest(data)
        try:
            while data.nbytes:
                written = os.pwrite(fd, data, offset)
                data, offset = data[written:], offset + written
        except OSError as exc:
            name = self._weight_map.get(key, "?")
            raise OSError(exc.errno, f"{exc.strerror} writing {key!r} to {name}") from exc
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
        record = {
            "format": _DIGESTS_FORMAT,
            "algorithm": DIGEST_ALGORITHM,
            "tensors": dict(sorted(self.digests.items())),
        }
        (self.directory / DIGESTS_FILE).write_text(json.dumps(record, indent=1) + "\n")
