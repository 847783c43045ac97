"""The tiled NVFP4 layout in numpy: where every byte goes, and back (no graph compiled)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnquant_kernels.layout import TILE_ROWS, cpu_prefers_tiled, tile_nvfp4, untile_nvfp4


def _random(rng: np.random.Generator, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    return (
        rng.integers(0, 256, (n, k // 2), dtype=np.uint8),
        rng.integers(0, 256, (n, k // 16), dtype=np.uint8),
    )


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 70), blocks=st.integers(1, 20), seed=st.integers(0, 2**16))
def test_tile_is_a_permutation_of_the_bytes_and_untile_inverts_it(n, blocks, seed):
    weight, scale = _random(np.random.default_rng(seed), n, 16 * blocks)
    tw, ts = tile_nvfp4(weight, scale)
    assert (tw.shape, tw.dtype, ts.shape, ts.dtype) == (
        weight.shape,
        np.uint8,
        scale.shape,
        np.uint8,
    )
    assert tw.flags.c_contiguous and ts.flags.c_contiguous
    back_w, back_s = untile_nvfp4(tw, ts)
    np.testing.assert_array_equal(back_w, weight)
    np.testing.assert_array_equal(back_s, scale)
    tail = (n // TILE_ROWS) * TILE_ROWS
    np.testing.assert_array_equal(tw[tail:], weight[tail:])  # the rows past the last tile
    np.testing.assert_array_equal(ts[tail:], scale[tail:])


def test_each_tile_holds_word_q_of_its_16_rows_side_by_side():
    """Tile t, word q (inputs 8q..8q+7), row i: the 4 bytes at 64 q + 4 i of the tile's 8 K
    bytes; scale block b of row i at 16 b + i of the tile's K bytes."""
    n, k = 35, 272
    weight, scale = _random(np.random.default_rng(3), n, k)
    tw, ts = tile_nvfp4(weight, scale)
    flat_w, flat_s = tw.reshape(-1), ts.reshape(-1)
    for t in range(n // TILE_ROWS):
        base_w, base_s = t * 8 * k, t * k
        for i in range(TILE_ROWS):
            row = t * TILE_ROWS + i
            for q in range(k // 8):
                got = flat_w[base_w + 64 * q + 4 * i : base_w + 64 * q + 4 * i + 4]
                np.testing.assert_array_equal(got, weight[row, 4 * q : 4 * q + 4])
            for b in range(k // 16):
                assert flat_s[base_s + 16 * b + i] == scale[row, b]


def test_float8_scales_keep_their_dtype():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    weight, scale = _random(np.random.default_rng(1), 32, 64)
    f8 = scale.view(ml_dtypes.float8_e4m3fn)
    _, ts = tile_nvfp4(weight, f8)
    assert ts.dtype == f8.dtype
    np.testing.assert_array_equal(ts.view(np.uint8), tile_nvfp4(weight, scale)[1])


@pytest.mark.parametrize(
    ("weight", "scale", "message"),
    [
        (np.zeros((4, 8), np.float32), np.zeros((4, 1), np.uint8), "uint8 \\[N, K/2\\]"),
        (np.zeros((4, 4), np.uint8), np.zeros((4, 1), np.uint8), "one byte \\[4, 0\\]"),
        (np.zeros((4, 8), np.uint8), np.zeros((4, 2), np.uint8), "one byte \\[4, 1\\]"),
        (np.zeros((4, 8), np.uint8), np.zeros((4, 1), np.float32), "one byte"),
    ],
)
def test_bad_shapes_are_refused(weight, scale, message):
    with pytest.raises(ValueError, match=message):
        tile_nvfp4(weight, scale)


def test_cpu_prefers_tiled_follows_avx512():
    import platform
    from pathlib import Path

    cpuinfo = Path("/proc/cpuinfo")
    if platform.machine().lower() not in ("x86_64", "amd64") or not cpuinfo.exists():
        assert cpu_prefers_tiled() is False
        return
    flags = {
        f
        for line in cpuinfo.read_text().splitlines()
        if line.startswith("flags")
        for f in line.split()
    }
    assert cpu_prefers_tiled() is ("avx512f" in flags)
