"""The tiled NVFP4 layout that ``generated_linear_nvfp4_tiled`` reads on the CPU (numpy only).

Model Optimizer's layout holds an NVFP4 weight ``[N, K]`` row by row: ``weight [N, K/2]`` (two
E2M1 codes a byte) and ``weight_scale [N, K/16]`` (one E4M3 byte per 16 inputs). A decode step
on the CPU decodes 16 weight rows at a time, one row per SIMD lane, and so reads 16 streams at
once. :func:`tile_nvfp4` rewrites the same bytes, in the same shapes, so that each tile of 16
rows is one stream: per 8 inputs (a 32-bit word of each row) the 16 rows' words side by side,
and per block of 16 inputs the 16 rows' scale bytes side by side. The ``N % 16`` rows past the
last whole tile stay row-major after the tiles. Nothing is padded: the bytes held are the
checkpoint's.

:func:`cpu_prefers_tiled` says where the tiled op is the faster one: an x86-64 CPU with AVX-512,
where its lane tiles are one ``vpermps`` per 16 codes. Elsewhere it runs, lane by lane, slower
than the row-major op, so serving keeps the row-major layout there.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

import numpy as np

__all__ = ["TILE_ROWS", "cpu_prefers_tiled", "tile_nvfp4", "untile_nvfp4"]

#: Weight rows of a tile: the float32 lanes of an AVX-512 register.
TILE_ROWS = 16


def _check(weight: np.ndarray, weight_scale: np.ndarray) -> tuple[int, int]:
    if weight.dtype != np.uint8 or weight.ndim != 2:
        raise ValueError(f"an NVFP4 weight is uint8 [N, K/2], got {weight.dtype} {weight.shape}")
    n, half = weight.shape
    k = 2 * half
    if k % 16 or weight_scale.shape != (n, k // 16) or weight_scale.itemsize != 1:
        raise ValueError(
            f"NVFP4 scales of a [{n}, {k}] weight are one byte [{n}, {k // 16}], got "
            f"{weight_scale.dtype} {weight_scale.shape}"
        )
    return n, k


def _regroup(a: np.ndarray, units: int, width: int, *, to_tiles: bool) -> np.ndarray:
    """``a [N, units * width]`` with each tile's ``[16 rows, units]`` of ``width``-byte units
    swapped to ``[units, 16 rows]`` (``to_tiles``) or back; the rows past the last tile kept."""
    rows = (a.shape[0] // TILE_ROWS) * TILE_ROWS
    order = (TILE_ROWS, units) if to_tiles else (units, TILE_ROWS)
    out = np.empty_like(a, order="C")
    out[:rows] = a[:rows].reshape(-1, *order, width).transpose(0, 2, 1, 3).reshape(rows, a.shape[1])
    out[rows:] = a[rows:]
    return out


def tile_nvfp4(weight: np.ndarray, weight_scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The tiled layout of an NVFP4 weight (module docstring): same shapes, dtypes and bytes.

    ``weight`` uint8 ``[N, K/2]`` and ``weight_scale`` (uint8 or float8_e4m3fn bytes)
    ``[N, K/16]``, row-major as Model Optimizer writes them; both come back C-contiguous.

    Raises
    ------
    ValueError
        The shapes or dtypes are not an NVFP4 weight's.
    """
    _, k = _check(weight, weight_scale)
    # Per tile: 32-bit words (8 inputs) of the 16 rows side by side; scale bytes likewise.
    return (
        _regroup(weight, k // 8, 4, to_tiles=True),
        _regroup(weight_scale, k // 16, 1, to_tiles=True),
    )


def untile_nvfp4(weight: np.ndarray, weight_scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The row-major layout back from :func:`tile_nvfp4`'s (its inverse, bit for bit)."""
    _, k = _check(weight, weight_scale)
    return (
        _regroup(weight, k // 8, 4, to_tiles=False),
        _regroup(weight_scale, k // 16, 1, to_tiles=False),
    )


@functools.cache
def cpu_prefers_tiled() -> bool:
    """Whether this host's CPU runs the tiled op faster: x86-64 with AVX-512 (``avx512f`` in
    ``/proc/cpuinfo``; ``False`` where that file is not there to ask, as on macOS)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(line.startswith("flags") and "avx512f" in line.split() for line in text.splitlines())
