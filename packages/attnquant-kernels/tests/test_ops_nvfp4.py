"""generated_linear_nvfp4 on the CPU through MAX, against numpy: dequantize, then the identity.

One compiled graph for the module (every dimension symbolic; :func:`build_linear_nvfp4`): the
op, the plain NVFP4 projection (no ``s``, ``U``, ``V``) and the op on bfloat16 activations. The
packed weights are random codes with E4M3 block scales (:func:`nvfp4_random`); the reference
dequantizes them in numpy (:func:`nvfp4_dequantize`, the arithmetic of
``attnquant_max.dequantize_nvfp4``; ``packages/attnquant-max/tests/test_nvfp4_kernel.py`` checks
that the two agree bit for bit) and applies the float64 identity.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnquant_kernels import MAX_RANK
from attnquant_kernels.layout import tile_nvfp4
from attnquant_kernels.testing import (
    F32_RTOL,
    OpModel,
    build_linear_nvfp4,
    build_linear_nvfp4_tiled,
    build_linear_nvfp4_tiled_a8,
    check_linear_nvfp4,
    check_linear_nvfp4_tiled,
    check_linear_nvfp4_tiled_a8,
    close,
    nvfp4_dequantize,
    nvfp4_random,
    quantize_activations_a8,
    theta,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def linear_nvfp4() -> OpModel:
    """Outputs: the op (float32), the plain NVFP4 projection, the op on bfloat16 activations,
    nvfp4_dequantize's W, and its bfloat16 W^T."""
    return build_linear_nvfp4("cpu")


#: (M, K, N, R): the shapes each layout is checked at.
CASES = [
    (1, 16, 1, 0),  # smallest: one block, one output
    (1, 16, 7, 16),  # in=16, odd out, decode
    (16, 16, 33, 0),  # in=16, M=16 (register tiles of 4 rows), odd out
    (16, 48, 5, 16),
    (3, 96, 9, 64),  # fewer rows than a tile, largest rank
    (5, 160, 130, 7),  # a tile plus a decode row, several parallel blocks
    (1, 2048, 67, 16),  # decode at a real width
    (16, 1024, 256, 16),
    # Below 8 rows on AVX-512: 16 weight rows in the lanes, 128 inputs a chunk, tiles of
    # 4, 2 and 1 input rows; a last part of the inputs padded; rows past the last 16 as above.
    (2, 128, 16, 0),  # one chunk, one tile
    (4, 256, 48, 3),  # two chunks, three tiles of 16 rows
    (7, 272, 80, 16),  # input tiles of 4, 2 and 1; two chunks and 16 inputs padded
    (6, 1024, 1040, 64),  # largest rank, several work items
    (1, 4096, 1030, 16),  # the decode of a down projection, a 6-row tail
    (64, 256, 40, 0),  # a whole batch block
    (70, 32, 18, 3),  # two batch blocks
    # From 16 rows on: panels of 64 (AVX-512) or 16 output columns decoded once, then
    # register tiles of 6 rows; the columns past the last whole panel as above.
    (16, 48, 64, 0),  # one whole panel, two tiles of 6 and one of 4
    (23, 64, 130, 5),  # two panels and a 2-column tail, a tile of 5 rows left
    (41, 32, 200, 64),  # largest rank: 64 more steps of every tile
    (512, 512, 192, 16),  # a prefill
    # Past 2048 inputs a panel takes them 2048 at a time, the sums in float32 scratch.
    (16, 4096, 64, 0),  # two whole blocks of inputs
    (20, 4112, 70, 16),  # a third block of 16, the correction with it, a 6-column tail
]


@pytest.fixture(scope="session")
def linear_nvfp4_tiled() -> OpModel:
    """generated_linear_nvfp4_tiled: the op (float32), the plain projection, the op on bfloat16."""
    return build_linear_nvfp4_tiled()


#: Model Optimizer's row-major layout, and the tiled one (generated_linear_nvfp4_tiled, CPU).
LAYOUTS = ["row-major", "tiled"]


def _op(request: pytest.FixtureRequest, layout: str) -> tuple[OpModel, Callable[..., None]]:
    """The compiled op of ``layout`` and the check of one random case on it."""
    if layout == "tiled":
        return request.getfixturevalue("linear_nvfp4_tiled"), check_linear_nvfp4_tiled
    return request.getfixturevalue("linear_nvfp4"), check_linear_nvfp4


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("M", "K", "N", "R"), CASES)
@pytest.mark.xdist_group("linear_nvfp4")
def test_linear_nvfp4_matches_dequantize_then_identity(
    request: pytest.FixtureRequest, layout: str, M: int, K: int, N: int, R: int
):
    """Both layouts at every shape. Tiled: lane tiles below 16 rows and past the last whole
    panel, panels from 16 rows, the rows past the last tile of 16 row-major."""
    model, check = _op(request, layout)
    check(model, M, K, N, R, seed=M * 1000 + R)


@pytest.mark.parametrize("layout", LAYOUTS)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    M=st.integers(1, 80),
    blocks=st.integers(1, 20),
    N=st.integers(1, 140),
    R=st.integers(0, MAX_RANK),
    seed=st.integers(0, 2**16),
)
@pytest.mark.xdist_group("linear_nvfp4")
def test_linear_nvfp4_random_shapes(
    request: pytest.FixtureRequest, layout: str, M: int, blocks: int, N: int, R: int, seed: int
):
    model, check = _op(request, layout)
    check(model, M, 16 * blocks, N, R, seed)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("M", [16, 5, 1])
@pytest.mark.xdist_group("linear_nvfp4")
def test_linear_nvfp4_decodes_every_code_and_scale_byte_exactly(
    request: pytest.FixtureRequest, layout: str, M: int
):
    """x = rows of the identity: the plain output is W^T itself, bit for bit.

    Row n of W has scale byte n (all 256: subnormals, negatives, and the NaN bytes 0x7F and
    0xFF, whose rows are NaN), its 16 codes random; global scale 1. Tiled: 16 tiles of one
    partial chunk each.
    """
    model, _ = _op(request, layout)
    rng = np.random.default_rng(7)
    weight = rng.integers(0, 256, (256, 8), dtype=np.uint8)
    weight_scale = np.arange(256, dtype=np.uint8).reshape(256, 1)
    weight_scale_2 = np.ones(1, np.float32)
    _, s, U, V = theta(rng, 256, 16, 0)
    x = np.eye(16, dtype=np.float32)[:M]
    packed = tile_nvfp4(weight, weight_scale) if layout == "tiled" else (weight, weight_scale)
    outs = model(x, *packed, weight_scale_2, s, U, V)
    W = nvfp4_dequantize(weight, weight_scale, weight_scale_2)
    assert np.isnan(W[[0x7F, 0xFF]]).all() and np.isfinite(np.delete(W, [0x7F, 0xFF], 0)).all()
    np.testing.assert_array_equal(outs[1], W.T[:M])
    if layout == "row-major":
        np.testing.assert_array_equal(outs[3], W)  # nvfp4_dequantize, NaN rows included


@pytest.mark.xdist_group("linear_nvfp4")
def test_linear_nvfp4_empty_batch(linear_nvfp4: OpModel):
    rng = np.random.default_rng(1)
    packed = nvfp4_random(rng, 6, 32)
    _, s, U, V = theta(rng, 6, 32, 3)
    outs = linear_nvfp4(np.zeros((0, 32), np.float32), *packed, s, U, V)
    assert [o.shape for o in outs] == [(0, 6)] * 3 + [(6, 32), (32, 6)]


def _bad(K: int, N: int, half: int, blocks: int, rank: int = 2) -> list[np.ndarray]:
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, K)).astype(np.float32)
    weight = rng.integers(0, 256, (N, half), dtype=np.uint8)
    weight_scale = np.full((N, blocks), 0x38, np.uint8)
    _, s, U, V = theta(rng, N, K, rank)
    return [x, weight, weight_scale, np.ones(1, np.float32), s, U, V]


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        (_bad(24, 4, 12, 1), r"x has 24 inputs, not a multiple of 16"),
        (_bad(32, 4, 15, 2), r"weight has size 15 along axis 1, expected 16"),
        (_bad(32, 4, 16, 3), r"weight_scale has size 3 along axis 1, expected 2"),
        (_bad(32, 4, 16, 2, rank=MAX_RANK + 1), r"correction rank r=65 is above 64.*GEMM=1"),
    ],
    ids=["in-not-16k", "weight-width", "scale-width", "rank-65"],
)
@pytest.mark.xdist_group("linear_nvfp4")
def test_linear_nvfp4_kernel_refuses_bad_shapes(
    linear_nvfp4: OpModel, arrays: Sequence[np.ndarray], message: str
):
    with pytest.raises(Exception, match=rf"generated_linear_nvfp4: {message}"):
        linear_nvfp4(*arrays)


# ---------------------------------------------------------------- the Python wrapper (no compile)


def _types(shapes_dtypes: Sequence[tuple[Sequence[int], str]]) -> list:
    """CPU tensor types of static ``(shape, dtype name)`` pairs."""
    from max.dtype import DType
    from max.graph import DeviceRef, TensorType

    return [
        TensorType(getattr(DType, dtype), list(shape), device=DeviceRef.CPU())
        for shape, dtype in shapes_dtypes
    ]


def _static(shapes_dtypes: Sequence[tuple[Sequence[int], str]]):
    """Build (never compile) a graph around the wrapper with static input shapes."""
    from max.graph import Graph

    from attnquant_kernels.graph import generated_linear_nvfp4

    with Graph("aq_nvfp4_static", input_types=_types(shapes_dtypes)) as g:
        g.output(generated_linear_nvfp4(*(v.tensor for v in g.inputs)))


GOOD = [([2, 32], "float32"), ([4, 16], "uint8"), ([4, 2], "uint8"), ([1], "float32")]


@pytest.mark.parametrize(
    ("index", "replacement", "error", "message"),
    [
        (0, ([2, 24], "float32"), ValueError, r"x has 24 inputs, not a multiple of 16"),
        (1, ([4, 8], "uint8"), ValueError, r"weight is \[out, 8\], expected \[out, 16\]"),
        (2, ([4, 4], "uint8"), ValueError, r"weight_scale is \[out, 4\], expected \[out, 2\]"),
        (2, ([5, 2], "uint8"), ValueError, r"weight has 4 rows and weight_scale 5"),
        (3, ([2], "float32"), ValueError, r"weight_scale_2 must hold one value"),
        (1, ([4, 16], "float32"), TypeError, r"weight is float32, expected uint8"),
        (2, ([4, 2], "float8_e4m3fn"), TypeError, r"weight_scale is float8_e4m3fn, expected"),
        (0, ([2, 32], "int32"), TypeError, r"x is int32"),
    ],
)
def test_wrapper_refuses_bad_static_shapes_and_dtypes(index, replacement, error, message):
    shapes = list(GOOD)
    shapes[index] = replacement
    with pytest.raises(error, match=rf"generated_linear_nvfp4: {message}"):
        _static(shapes)


#: The packed weight, block scales and tensor scale of a [4, 32] NVFP4 weight.
GOOD_PACKED = [([4, 16], "uint8"), ([4, 2], "uint8"), ([1], "float32")]


@pytest.mark.parametrize(
    ("index", "replacement", "dtype", "error", "message"),
    [
        (0, ([4, 12], "uint8"), "float32", ValueError, r"weight holds 24 inputs, not a multiple of 16"),
        (1, ([4, 3], "uint8"), "float32", ValueError, r"weight_scale is \[out, 3\], expected \[out, 2\]"),
        (1, ([5, 2], "uint8"), "float32", ValueError, r"weight has 4 rows and weight_scale 5"),
        (2, ([1], "float16"), "float32", TypeError, r"weight_scale_2 is float16, expected float32"),
        (None, None, "int8", TypeError, r"W must be float32, bfloat16 or float16, not int8"),
    ],
    ids=["in-not-16k", "scale-width", "rows", "scale_2-dtype", "out-dtype"],
)  # fmt: skip
def test_dequantize_wrapper_refuses_bad_static_shapes_and_dtypes(
    index, replacement, dtype, error, message
):
    from max.dtype import DType
    from max.graph import Graph

    from attnquant_kernels.graph import nvfp4_dequantize

    shapes = list(GOOD_PACKED)
    if index is not None:
        shapes[index] = replacement
    with (
        pytest.raises(error, match=rf"nvfp4_dequantize: {message}"),
        Graph("aq_nvfp4_dequantize_static", input_types=_types(shapes)) as g,
    ):
        g.output(nvfp4_dequantize(*(v.tensor for v in g.inputs), getattr(DType, dtype)))


@pytest.fixture(scope="session")
def linear_nvfp4_tiled_a8() -> OpModel:
    """generated_linear_nvfp4_tiled_a8: the op and the plain projection (float32)."""
    return build_linear_nvfp4_tiled_a8()


#: (M, K, N, R) for int8 activations: the integer tiles (4, 2 and 1 rows at a time, with outputs
#: past the last tile of 16 in float) at every row count: decode steps, streams, a prefill.
A8_CASES = [
    (1, 16, 16, 0),  # one block, one tile
    (1, 16, 7, 16),  # no whole tile: every row in float
    (1, 1024, 3072, 0),  # a merged q/k/v decode step
    (1, 4096, 1030, 16),  # a down projection's decode, a 6-row tail in float
    (3, 272, 80, 16),  # tiles of 2 and 1 input rows, 17 blocks
    (7, 160, 130, 64),  # 4 + 2 + 1 input rows, largest rank, a 2-row tail
    (8, 256, 48, 3),  # two tiles of 4 rows
    (16, 1024, 256, 16),  # where the float op takes panels
    (33, 64, 100, 5),  # 8 tiles of 4 rows and one of 1, rounded in 3 parallel chunks
    (150, 512, 96, 16),  # 3 row chunks (64, 64, 22) x 6 tiles
]


@pytest.mark.parametrize(("M", "K", "N", "R"), A8_CASES)
@pytest.mark.xdist_group("linear_nvfp4")
def test_linear_nvfp4_a8_matches_rounded_activations_then_identity(
    linear_nvfp4_tiled_a8: OpModel, M: int, K: int, N: int, R: int
):
    """The integer op equals the float64 identity over x rounded to int8 per group of 64."""
    check_linear_nvfp4_tiled_a8(linear_nvfp4_tiled_a8, M, K, N, R, seed=M * 1000 + R)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    M=st.integers(1, 80),
    blocks=st.integers(1, 40),
    N=st.integers(1, 100),
    R=st.integers(0, MAX_RANK),
    seed=st.integers(0, 2**16),
    group=st.integers(0, 9),
    factor=st.sampled_from([1.0, 0.0, 1e-6, 2.0**-50]),
)
@pytest.mark.xdist_group("linear_nvfp4")
def test_linear_nvfp4_a8_random_shapes(
    linear_nvfp4_tiled_a8: OpModel,
    M: int,
    blocks: int,
    N: int,
    R: int,
    seed: int,
    group: int,
    factor: float,
):
    """Any shape, heavy-tailed inputs, one group of 64 scaled by ``factor``: zeros, a step far
    below its neighbours' (their ratio 1e6), or below the flush (2^-50 of the row: zeros)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_t(3, (M, 16 * blocks)).astype(np.float32)
    x[:, 64 * group : 64 * group + 64] *= np.float32(factor)
    check_linear_nvfp4_tiled_a8(linear_nvfp4_tiled_a8, M, 16 * blocks, N, R, seed, x=x)


@pytest.mark.parametrize("M", [16, 5, 1])
@pytest.mark.xdist_group("linear_nvfp4")
def test_linear_nvfp4_a8_decodes_every_scale_byte(linear_nvfp4_tiled_a8: OpModel, M: int):
    """Row n of W has scale byte n in all 4 blocks (all 256: subnormals, negatives, the NaN
    bytes), in tiles of 8, 4 and 1 input rows. Each output column is the identity over the
    rounded x, relative to its own size (columns of zeros exactly); the NaN bytes give NaN."""
    rng = np.random.default_rng(11)
    weight = rng.integers(0, 256, (256, 32), dtype=np.uint8)
    weight_scale = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 4, axis=1)
    weight_scale_2 = np.ones(1, np.float32)
    _, s, U, V = theta(rng, 256, 64, 0)
    x = rng.standard_normal((M, 64)).astype(np.float32)
    y, _ = linear_nvfp4_tiled_a8(x, *tile_nvfp4(weight, weight_scale), weight_scale_2, s, U, V)
    W = nvfp4_dequantize(weight, weight_scale, weight_scale_2).astype(np.float64)
    want = s.astype(np.float64) * (quantize_activations_a8(x) @ W.T)
    nan = [0x7F, 0xFF]
    assert np.isnan(y[:, nan]).all()
    for n in np.delete(np.arange(256), nan):
        close(y[:, n], want[:, n], F32_RTOL, f"a8 scale byte {n:#04x} M={M}")


def test_a8_rounding_steps_per_group_and_flushes_negligible_groups():
    """The reference rounding: one step per 64 inputs (the last group short), a group at most
    2^-40 of its row's largest input rounded to zeros, one above it kept."""
    x = np.ones((1, 208), np.float32)  # groups of 64, 64, 64 and 16 inputs
    x[0, 0] = 127.0  # the first group's step is 1: its other inputs round to 1
    x[0, 64:128] = 2.0**-45  # below 2^-40 of 127: zeros
    x[0, 128:192] *= np.float32(1e-9)  # kept, a step 1e-9 of the first's
    x[0, 192] = 0.5  # the short last group: 0.5 and fifteen 1s round to 64 and 127 of 127
    xq = quantize_activations_a8(x)
    np.testing.assert_array_equal(xq[0, :64], np.r_[127.0, np.ones(63)])
    np.testing.assert_array_equal(xq[0, 64:128], 0)
    np.testing.assert_allclose(xq[0, 128:192], 1e-9, rtol=1e-6)
    np.testing.assert_allclose(xq[0, 192:], np.r_[64 / 127, np.ones(15)])


@pytest.mark.xdist_group("linear_nvfp4")
def test_linear_nvfp4_a8_error_is_the_rounding_of_x(linear_nvfp4_tiled_a8: OpModel):
    """Against the float projection the integer op's error is small but not zero: what
    rounding x to int8 costs (a check that the op really rounds, and by how much)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 2048)).astype(np.float32)
    weight, weight_scale, weight_scale_2 = nvfp4_random(rng, 512, 2048)
    W = nvfp4_dequantize(weight, weight_scale, weight_scale_2).astype(np.float64)
    _, s, U, V = theta(rng, 512, 2048, 0)
    _, y0 = linear_nvfp4_tiled_a8(x, *tile_nvfp4(weight, weight_scale), weight_scale_2, s, U, V)
    exact = x.astype(np.float64) @ W.T
    rel = np.abs(y0 - exact).max() / np.abs(exact).max()
    assert 1e-4 < rel < 2e-2, rel
