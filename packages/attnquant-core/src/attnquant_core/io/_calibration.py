"""The calibration statistics file: a public, model-agnostic format.

One safetensors file. For each projection whose input was observed, the key
``<projection weight key without .weight>.input_gram`` (for example
``model.layers.3.self_attn.q_proj.input_gram``) holds ``G = sum_t x_t x_t^T`` over the
calibration tokens, float32 or float64, ``[in, in]``; ``__metadata__`` holds
``{"tokens": "<count>"}``. A projection may be absent (it is then fit unwhitened). Any tool
can write it; ``safetensors.numpy.save_file(grams, path, metadata={"tokens": str(n)})`` does.

A gram is validated when read: square, float32/float64, finite and symmetric. Whether it is
positive semi-definite beyond the damping is decided when a whitening factor is made from it
(:func:`attnquant_core.calib.whitening`), where a Cholesky factorisation is attempted anyway.

Memory: a gram is read with plain file reads, a few MiB of rows at a time, straight into its
float64 array (no float32 copy of the whole gram, no memory map), and checked a block of rows
at a time (no ``G - G^T`` or ``|G|`` of full size): reading an ``[n, n]`` gram holds the
``8 n^2`` bytes of the result and a few MiB more.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import numpy as np
from safetensors import safe_open

from .._errors import AttnquantError

__all__ = [
    "GRAM_SUFFIX",
    "CalibrationError",
    "CalibrationStats",
    "StatsWriter",
    "gram_key",
    "read_stats",
    "stats_digest",
    "write_stats",
]

GRAM_SUFFIX = ".input_gram"
_DTYPES = {"F32": np.float32, "F64": np.float64}
_CODES = {np.dtype(np.float32): "F32", np.dtype(np.float64): "F64"}
# Asymmetry tolerated, relative to the largest |G| entry: float32 sums of many tokens in
# another tool's order differ from their transpose's by rounding only.
_SYMMETRY_RTOL = 1e-4
# Bytes of a gram read or checked at a time (a block of whole rows, at least one row).
_BLOCK_BYTES = 4 << 20


def _row_blocks(n: int, itemsize: int = 8) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` of row blocks of an ``[n, n]`` array, ``_BLOCK_BYTES`` or one row each."""
    rows = max(1, _BLOCK_BYTES // max(1, n * itemsize))
    for start in range(0, n, rows):
        yield start, min(n, start + rows)


class CalibrationError(AttnquantError, ValueError):
    """A calibration statistics file (or the data to make one) is missing or malformed."""


def gram_key(weight_key: str) -> str:
    """``model.layers.3.self_attn.q_proj.weight`` -> ``model.layers.3.self_attn.q_proj.input_gram``."""
    if weight_key.endswith(GRAM_SUFFIX):
        return weight_key
    stem = weight_key[: -len(".weight")] if weight_key.endswith(".weight") else weight_key
    return stem + GRAM_SUFFIX


def stats_digest(path: str | Path) -> str:
    """``sha256:<hex>`` of the file's bytes (what a manifest records of the statistics used)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return f"sha256:{digest.hexdigest()}"


class CalibrationStats:
    """An opened statistics file: headers validated up front, each gram validated when read.

    Use :func:`read_stats` to open one. ``tokens`` is the calibration token count, ``keys`` the
    weight keys (``....weight``) that have a gram, ``digest`` the file's sha256.
    """

    def __init__(
        self,
        path: Path,
        tokens: int,
        shapes: dict[str, tuple[int, ...]],
        dtypes: dict,
        offsets: dict[str, int],
    ):
        self.path = path
        self.tokens = tokens
        self._shapes = shapes  # by gram key
        self._dtypes = dtypes
        self._offsets = offsets  # absolute byte offset of each gram's data in the file
        self._digest: str | None = None

    def __repr__(self) -> str:
        return f"CalibrationStats({str(self.path)!r}, tokens={self.tokens}, grams={len(self)})"

    def __len__(self) -> int:
        return len(self._shapes)

    def __contains__(self, weight_key: object) -> bool:
        return isinstance(weight_key, str) and gram_key(weight_key) in self._shapes

    @property
    def keys(self) -> list[str]:
        """Weight keys (``<stem>.weight``) that have a gram, sorted."""
        return sorted(k[: -len(GRAM_SUFFIX)] + ".weight" for k in self._shapes)

    @property
    def digest(self) -> str:
        if self._digest is None:
            self._digest = stats_digest(self.path)
        return self._digest

    def shape(self, weight_key: str) -> tuple[int, ...]:
        return self._shapes[gram_key(weight_key)]

    def gram(self, weight_key: str, *, in_features: int | None = None) -> np.ndarray | None:
        """The validated gram of ``weight_key`` in float64, or None when the file has none.

        ``in_features``, when given, is the projection's input width the gram must match.
        """
        read = self.read_gram(weight_key, in_features=in_features)
        return None if read is None else read[0]

    def read_gram(
        self, weight_key: str, *, in_features: int | None = None
    ) -> tuple[np.ndarray, str] | None:
        """:meth:`gram` and the ``sha256:<hex>`` of the gram's stored bytes (with its dtype and
        shape): equal digests, equal grams (q/k/v of a layer share one input, so one gram).

        The result is a fresh array the caller owns (it may overwrite it).
        """
        key = gram_key(weight_key)
        if key not in self._shapes:
            return None
        where = f"{self.path}: {key!r}"
        shape = self._shapes[key]
        if in_features is not None and shape != (in_features, in_features):
            raise CalibrationError(
                f"{where} has shape {list(shape)} but the projection's input is {in_features} "
                f"wide (expected [{in_features}, {in_features}]); the statistics are of another "
                f"model"
            )
        dtype = np.dtype(_DTYPES[self._dtypes[key]]).newbyteorder("<")
        digest = hashlib.sha256(f"{dtype.str}{list(shape)}".encode())
        n = shape[0]
        G = np.empty((n, n), np.float64)
        with open(self.path, "rb") as f:
            f.seek(self._offsets[key])
            for start, stop in _row_blocks(n, dtype.itemsize):
                want = (stop - start) * n * dtype.itemsize
                block = f.read(want)
                if len(block) != want:
                    raise CalibrationError(f"{where}: the file is truncated")
                digest.update(block)
                G[start:stop] = np.frombuffer(block, dtype=dtype).reshape(stop - start, n)
                del block
        check_gram(G, where)
        return G, f"sha256:{digest.hexdigest()}"

    def grams(self) -> Iterator[tuple[str, np.ndarray]]:
        """Every (weight key, validated float64 gram), one at a time."""
        for weight_key in self.keys:
            G = self.gram(weight_key)
            assert G is not None
            yield weight_key, G

    def validate(self) -> None:
        """Read and check every gram (finite, symmetric); raises on the first bad one."""
        for _ in self.grams():
            pass


def check_gram(G: np.ndarray, where: str) -> None:
    """Finite, square and symmetric, else a one-line :class:`CalibrationError` naming ``where``."""
    if G.ndim != 2 or G.shape[0] != G.shape[1]:
        raise CalibrationError(f"{where} has shape {list(G.shape)}; a gram is square [in, in]")
    # A block of rows at a time: no temporary of G's size (the maxima are exact either way).
    n = G.shape[0]
    blocks = list(_row_blocks(n))
    bad = sum(int(np.count_nonzero(~np.isfinite(G[i:j]))) for i, j in blocks)
    if bad:
        raise CalibrationError(f"{where} holds {bad} NaN/Inf value(s); recompute the statistics")
    scale = asym = 0.0
    for i, j in blocks:
        scale = max(scale, float(np.abs(G[i:j]).max()))
        d = G[i:j] - G[:, i:j].T
        asym = max(asym, float(np.abs(d, out=d).max()))
        del d
    if asym > _SYMMETRY_RTOL * scale:
        raise CalibrationError(
            f"{where} is not symmetric (max |G - G^T| = {asym:.3g}, max |G| = {scale:.3g}); "
            f"a gram is sum_t x_t x_t^T"
        )
    if G.size and float(np.diagonal(G).min()) < -_SYMMETRY_RTOL * scale:
        raise CalibrationError(
            f"{where} has a negative diagonal entry ({float(np.diagonal(G).min()):.3g}); "
            f"a gram is positive semi-definite"
        )


def read_stats(path: str | Path) -> CalibrationStats:
    """Open a statistics file and check its headers (keys, dtypes, shapes, token count)."""
    path = Path(path)
    if not path.is_file():
        raise CalibrationError(f"{path}: no such calibration statistics file")
    try:
        with safe_open(path, framework="numpy") as f:
            metadata = f.metadata() or {}
            keys = list(f.keys())
            slices = {k: f.get_slice(k) for k in keys}
            shapes = {k: tuple(slices[k].get_shape()) for k in keys}
            dtypes = {k: slices[k].get_dtype() for k in keys}
    except (OSError, ValueError, RuntimeError) as exc:
        raise CalibrationError(f"{path}: not a readable safetensors file ({exc})") from None
    if "tokens" not in metadata:
        raise CalibrationError(
            f"{path}: __metadata__ has no 'tokens' (the calibration token count); write it as "
            f'metadata={{"tokens": "<count>"}}'
        )
    try:
        tokens = int(metadata["tokens"])
    except ValueError:
        tokens = -1
    if tokens <= 0:
        raise CalibrationError(
            f"{path}: __metadata__ 'tokens' is {metadata['tokens']!r}; expected a positive integer"
        )
    for key in keys:
        if not key.endswith(GRAM_SUFFIX):
            raise CalibrationError(
                f"{path}: {key!r} is not a gram key (expected '<projection>{GRAM_SUFFIX}', e.g. "
                f"'model.layers.0.self_attn.q_proj{GRAM_SUFFIX}')"
            )
        if dtypes[key] not in _DTYPES:
            raise CalibrationError(f"{path}: {key!r} is {dtypes[key]}; grams are F32 or F64")
        shape = shapes[key]
        if len(shape) != 2 or shape[0] != shape[1]:
            raise CalibrationError(
                f"{path}: {key!r} has shape {list(shape)}; a gram is square [in, in]"
            )
    return CalibrationStats(path, tokens, shapes, dtypes, _data_offsets(path, keys))


def _data_offsets(path: Path, keys: Iterable[str]) -> dict[str, int]:
    """Absolute file offset of each tensor's data (safetensors: 8-byte header length, JSON
    header, then the data, each tensor at ``data_offsets`` from its start)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return {k: 8 + length + int(header[k]["data_offsets"][0]) for k in keys}


class StatsWriter:
    """Write a statistics file streamed, one gram at a time, renamed into place when complete.

    The shapes are declared up front (safetensors puts every offset in the header), so a
    calibration run holds one layer's grams, not the model's::

        with StatsWriter(path, shapes, tokens=n) as w:
            for key, G in ...:
                w.write(key, G)

    Keys are weight keys or gram keys; they must be written in the declared order.
    """

    def __init__(
        self,
        path: str | Path,
        shapes: Mapping[str, int],
        *,
        tokens: int,
        dtype: np.dtype | type = np.float32,
    ) -> None:
        self.path = Path(path)
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODES:
            raise CalibrationError(f"grams are stored as float32 or float64, not {self.dtype}")
        if tokens <= 0:
            raise CalibrationError(f"tokens must be positive, got {tokens}")
        self.order = [gram_key(k) for k in shapes]
        self.widths = {gram_key(k): int(n) for k, n in shapes.items()}
        header: dict[str, object] = {"__metadata__": {"tokens": str(int(tokens))}}
        offset = 0
        for key in self.order:
            n = self.widths[key] * self.widths[key] * self.dtype.itemsize
            header[key] = {
                "dtype": _CODES[self.dtype],
                "shape": [self.widths[key]] * 2,
                "data_offsets": [offset, offset + n],
            }
            offset += n
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self._header = struct.pack("<Q", len(blob)) + blob
        self._next = 0
        self._file = None
        self._tmp: str | None = None

    def __enter__(self) -> StatsWriter:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, self._tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        self._file = os.fdopen(fd, "wb")
        self._file.write(self._header)
        return self

    def write(self, key: str, G: np.ndarray) -> None:
        assert self._file is not None, "use StatsWriter as a context manager"
        key = gram_key(key)
        if self._next >= len(self.order) or self.order[self._next] != key:
            expected = self.order[self._next] if self._next < len(self.order) else "nothing"
            raise CalibrationError(f"{key!r} written out of order (expected {expected})")
        n = self.widths[key]
        if G.shape != (n, n):
            raise CalibrationError(f"{key!r} has shape {list(G.shape)}, declared [{n}, {n}]")
        self._file.write(np.ascontiguousarray(G, dtype=self.dtype.newbyteorder("<")).tobytes())
        self._next += 1

    def __exit__(self, exc_type, exc, tb) -> None:
        assert self._file is not None and self._tmp is not None
        self._file.close()
        if exc_type is None and self._next != len(self.order):
            missing = self.order[self._next]
            os.unlink(self._tmp)
            raise CalibrationError(f"{self.path}: {missing!r} was declared but never written")
        if exc_type is not None:
            os.unlink(self._tmp)
            return
        os.replace(self._tmp, self.path)


def write_stats(
    path: str | Path,
    grams: Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]],
    *,
    tokens: int,
    dtype: np.dtype | type = np.float32,
) -> Path:
    """Write ``{weight or gram key: G}`` as a statistics file (atomically); returns the path."""
    items = list(grams.items()) if isinstance(grams, Mapping) else list(grams)
    for key, G in items:
        check_gram(np.asarray(G, dtype=np.float64), repr(gram_key(key)))
    shapes = {key: int(np.shape(G)[0]) for key, G in items}
    with StatsWriter(path, shapes, tokens=tokens, dtype=dtype) as writer:
        for key, G in items:
            writer.write(key, np.asarray(G))
    return Path(path)
