"""The numpy NVFP4 reference: known values, rounding and scale rules, refusals, error bound."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnquant_core.forms import (
    BLOCK_SIZE,
    E2M1_VALUES,
    E4M3_MAX,
    E4M3_MIN_SUBNORMAL,
    E4M3_VALUES,
    NVFP4Error,
    NVFP4Tensor,
    dequantize_nvfp4,
    e2m1_codes,
    nvfp4_error_bound,
    pack_nibbles,
    quantize_nvfp4,
    unpack_nibbles,
)

F8 = ml_dtypes.float8_e4m3fn
# A tensor whose amax is 6 * 448 * 2**-10 has weight_scale_2 = 2**-10 exactly; a block with that
# amax gets scale 448 and a dequantized step D = 448 * 2**-10 = 0.4375, all exact in float32.
SCALE_2 = np.float32(2.0**-10)
AMAX = np.float32(6 * 448 * 2.0**-10)
D = np.float32(448 * 2.0**-10)


def with_exact_scale(rows: np.ndarray) -> np.ndarray:
    """Prepend one block whose amax pins weight_scale_2 to 2**-10 (and its scale to 448)."""
    rows = np.atleast_2d(np.asarray(rows, np.float32))
    anchor = np.zeros((1, rows.shape[1]), np.float32)
    anchor[0, 0] = AMAX
    return np.concatenate([anchor, rows])


def codes_of(q: NVFP4Tensor) -> np.ndarray:
    return unpack_nibbles(q.weight)


# -- the E2M1 code table and packing ---------------------------------------------------------


def test_e2m1_table_is_sign_and_magnitude():
    magnitudes = [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    np.testing.assert_array_equal(E2M1_VALUES[:8], magnitudes)
    np.testing.assert_array_equal(E2M1_VALUES[8:], -np.array(magnitudes, np.float32))
    assert E2M1_VALUES.dtype == np.float32


def test_every_code_round_trips_and_packs_low_nibble_first():
    # Codes 0..15 in order along one block; code 8 (negative zero) comes from a small negative.
    values = E2M1_VALUES * D
    values[8] = -0.2 * D
    q = quantize_nvfp4(with_exact_scale(values))
    assert q.weight_scale_2 == SCALE_2
    assert q.weight_scale[1, 0].astype(np.float32) == E4M3_MAX
    np.testing.assert_array_equal(codes_of(q)[1], np.arange(16))
    # Element 2j in the low nibble, 2j + 1 in the high one: 0x10, 0x32, ..., 0xFE.
    np.testing.assert_array_equal(q.weight[1], [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE])
    np.testing.assert_array_equal(dequantize_nvfp4(q)[1], E2M1_VALUES * D)


@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("code", range(8))
def test_each_e2m1_value_is_exact(code: int, sign: float):
    x = np.zeros(BLOCK_SIZE, np.float32)
    x[0] = AMAX  # pins the block's scale to 448 and its step to D
    x[3] = sign * E2M1_VALUES[code] * D
    q = quantize_nvfp4(with_exact_scale(x), name="one")
    expected = code | (8 if sign < 0 and code else 0)
    assert codes_of(q)[1, 3] == expected
    assert dequantize_nvfp4(q)[1, 3] == x[3]


def test_pack_and_unpack_are_inverse():
    np.testing.assert_array_equal(pack_nibbles(np.array([[1, 2, 15, 0]])), [[0x21, 0x0F]])
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, (5, 32), dtype=np.uint8)
    np.testing.assert_array_equal(unpack_nibbles(pack_nibbles(codes)), codes)
    with pytest.raises(NVFP4Error, match="odd"):
        pack_nibbles(np.zeros((1, 3), np.uint8))


# -- rounding: nearest, ties to the even code, saturating ------------------------------------

# (value, expected magnitude code); the even codes 0, 2, 4, 6 are 0, 1, 2, 4.
TIES = [
    (0.25, 0),  # between 0 (code 0) and 0.5 (code 1)
    (0.75, 2),  # between 0.5 (1) and 1 (2)
    (1.25, 2),  # between 1 (2) and 1.5 (3)
    (1.75, 4),  # between 1.5 (3) and 2 (4)
    (2.5, 4),  # between 2 (4) and 3 (5)
    (3.5, 6),  # between 3 (5) and 4 (6)
    (5.0, 6),  # between 4 (6) and 6 (7)
]


@pytest.mark.parametrize(("value", "code"), TIES)
def test_ties_go_to_the_even_code(value: float, code: int):
    x = np.float32(value)
    assert e2m1_codes(np.array([x]))[0] == code
    assert e2m1_codes(np.array([-x]))[0] == code | 8
    above, below = np.nextafter(x, np.float32(7)), np.nextafter(x, np.float32(0))
    lower = np.searchsorted(E2M1_VALUES[:8], x) - 1  # the code just below the midpoint
    assert e2m1_codes(np.array([above]))[0] == lower + 1
    assert e2m1_codes(np.array([below]))[0] == lower
    # The same through the whole quantizer, where the tie is value * D (exact in float32).
    block = np.full(BLOCK_SIZE, x * D, np.float32)
    block[0] = AMAX
    q = quantize_nvfp4(with_exact_scale(block))
    assert (codes_of(q)[1, 1:] == code).all()


def test_magnitudes_above_six_saturate():
    x = np.array([6.0, 6.4, 7.0, 1e30, -6.5], np.float32)
    np.testing.assert_array_equal(e2m1_codes(x), [7, 7, 7, 7, 15])


def test_zero_and_negative_zero_encode_as_code_zero():
    np.testing.assert_array_equal(e2m1_codes(np.array([0.0, -0.0], np.float32)), [0, 0])
    np.testing.assert_array_equal(e2m1_codes(np.array([-0.1], np.float32)), [8])


# -- the scales --------------------------------------------------------------------------------


@pytest.mark.parametrize("amax", [1.0, 0.02, 3.7e-3, 123.0, 1e-6, 5e4])
def test_tensor_scale_is_amax_over_6_times_448(amax: float):
    rng = np.random.default_rng(1)
    W = rng.uniform(-1, 1, (8, 64)).astype(np.float32)
    W *= np.float32(amax) / np.abs(W).max()
    q = quantize_nvfp4(W)
    assert q.weight_scale_2.dtype == np.float32 and q.weight_scale_2.shape == ()
    assert q.weight_scale_2 == np.float32(np.abs(W).max()) / np.float32(6 * 448)
    # The block holding amax lands on 448: saturated, never past it (E4M3 has no infinity and
    # float32 rounding of amax / (6 * scale_2) can land just above 448).
    scales = q.weight_scale.astype(np.float32)
    assert scales.max() == E4M3_MAX
    assert np.isfinite(scales).all()


# (unrounded block scale, its E4M3 value): ties to even, subnormals, the 2**-9 floor.
SCALES = [
    (13.0, 13.0),
    (1.0625, 1.0),  # tie between 1 and 1.125 -> even mantissa
    (1.1875, 1.25),  # tie between 1.125 and 1.25 -> even mantissa
    (300.0, 288.0),  # spacing 32 above 256: 300 -> 288
    (3 * 2.0**-9, 3 * 2.0**-9),  # subnormal, exact
    (2.0**-11, 2.0**-9),  # below the smallest subnormal: clamped up, not zero
]


@pytest.mark.parametrize(("raw", "stored"), SCALES)
def test_block_scale_rounds_to_e4m3(raw: float, stored: float):
    block_amax = np.float32(raw) * np.float32(6) * SCALE_2  # exact: raw * 6 / 1024
    x = np.zeros(BLOCK_SIZE, np.float32)
    x[0] = block_amax
    q = quantize_nvfp4(with_exact_scale(x))
    assert q.weight_scale_2 == SCALE_2
    assert q.weight_scale.dtype == F8
    assert q.weight_scale[1, 0].astype(np.float32) == np.float32(stored)


def test_e4m3_table_matches_ml_dtypes():
    assert E4M3_VALUES[0x7E] == 448 and np.isnan(E4M3_VALUES[0x7F])
    assert E4M3_VALUES[0x01] == E4M3_MIN_SUBNORMAL and E4M3_VALUES[0x38] == 1.0
    codes = np.arange(256, dtype=np.uint8)
    finite = ~np.isnan(E4M3_VALUES)
    np.testing.assert_array_equal(E4M3_VALUES[finite], codes.view(F8).astype(np.float32)[finite])


# -- zeros -------------------------------------------------------------------------------------


def test_all_zero_block_gets_scale_one_and_zero_codes():
    rng = np.random.default_rng(2)
    W = rng.standard_normal((4, 48)).astype(np.float32)
    W[2, 16:32] = 0
    q = quantize_nvfp4(W)
    assert q.weight_scale[2, 1].astype(np.float32) == 1.0
    assert (codes_of(q)[2, 16:32] == 0).all()
    D_ = dequantize_nvfp4(q)
    assert np.isfinite(D_).all() and (D_[2, 16:32] == 0).all()


def test_all_zero_tensor_is_finite_and_zero():
    q = quantize_nvfp4(np.zeros((3, 32), np.float32), name="zeros")
    assert np.isfinite(q.weight_scale_2) and q.weight_scale_2 > 0
    assert np.isfinite(q.weight_scale.astype(np.float32)).all()
    assert (q.weight == 0).all()
    assert (dequantize_nvfp4(q) == 0).all()


def test_tiny_block_beside_large_ones_stays_finite():
    W = np.ones((2, 32), np.float32)
    W[1, :16] = 1e-30
    q = quantize_nvfp4(W)
    assert q.weight_scale[1, 0].astype(np.float32) == E4M3_MIN_SUBNORMAL
    D_ = dequantize_nvfp4(q)
    assert np.isfinite(D_).all()
    assert (np.abs(W - D_) <= nvfp4_error_bound(W, q)).all()


# -- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(4, 24), (4, 8), (2, 17)])
def test_inner_dimension_not_multiple_of_16_is_refused(shape):
    with pytest.raises(NVFP4Error, match=r"layers\.0\.q_proj\.weight: inner dimension") as info:
        quantize_nvfp4(np.ones(shape, np.float32), name="layers.0.q_proj.weight")
    assert isinstance(info.value, ValueError)
    assert "multiple of 16" in str(info.value)


@pytest.mark.parametrize("shape", [(32,), (2, 2, 32), ()])
def test_non_2d_is_refused(shape):
    with pytest.raises(NVFP4Error, match="w: NVFP4 quantizes 2-D weights"):
        quantize_nvfp4(np.ones(shape, np.float32), name="w")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_is_refused(bad):
    W = np.ones((2, 32), np.float32)
    W[1, 5] = bad
    with pytest.raises(NVFP4Error, match="mlp.up_proj.weight: holds 1 NaN/Inf"):
        quantize_nvfp4(W, name="mlp.up_proj.weight")


def test_integer_weights_are_refused():
    with pytest.raises(NVFP4Error, match="dtype int32"):
        quantize_nvfp4(np.ones((2, 32), np.int32))


def test_inconsistent_tensor_is_refused():
    with pytest.raises(NVFP4Error, match="weight_scale"):
        NVFP4Tensor(
            weight=np.zeros((2, 16), np.uint8),
            weight_scale=np.zeros((2, 1), F8),
            weight_scale_2=np.asarray(1.0, np.float32),
        )


# -- the error bound ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, ml_dtypes.bfloat16])
def test_error_within_the_format_bound_for_every_block(dtype):
    rng = np.random.default_rng(3)
    # Rows of very different magnitudes, heavy tails, and one row of outliers.
    W = rng.standard_t(3, (64, 256)) * np.exp(rng.uniform(-4, 4, (64, 1)))
    W[5, 7] = 200.0
    W = W.astype(dtype)
    q = quantize_nvfp4(W)
    D_ = dequantize_nvfp4(q)
    assert D_.dtype == np.float32 and D_.shape == W.shape
    err = np.abs(W.astype(np.float32) - D_)
    assert (err <= nvfp4_error_bound(W, q)).all()
    # Coarser, per block: a normal E4M3 scale is within 2**-4 of block_amax / 6 / scale_2, so
    # no element is off by more than (1 + 2**-4) * block_amax / 6.
    block_amax = np.abs(W.astype(np.float32)).reshape(64, -1, BLOCK_SIZE).max(-1)
    block_err = err.reshape(64, -1, BLOCK_SIZE).max(-1)
    normal = block_amax / (6 * q.weight_scale_2) >= 2.0**-6
    assert (block_err[normal] <= (1 + 2.0**-4) * block_amax[normal] / 6 * (1 + 1e-6)).all()


def test_bfloat16_input_matches_its_float32_value():
    rng = np.random.default_rng(4)
    W = rng.standard_normal((16, 64)).astype(ml_dtypes.bfloat16)
    a, b = quantize_nvfp4(W), quantize_nvfp4(W.astype(np.float32))
    np.testing.assert_array_equal(a.weight, b.weight)
    np.testing.assert_array_equal(a.weight_scale.view(np.uint8), b.weight_scale.view(np.uint8))
    assert a.weight_scale_2 == b.weight_scale_2


@settings(max_examples=60, deadline=None)
@given(
    out_dim=st.integers(1, 9),
    blocks=st.integers(1, 4),
    log_scale=st.floats(-20, 20),
    zero_fraction=st.sampled_from([0.0, 0.3, 1.0]),
    seed=st.integers(0, 2**32 - 1),
)
def test_property_layout_and_bound(out_dim, blocks, log_scale, zero_fraction, seed):
    rng = np.random.default_rng(seed)
    in_dim = blocks * BLOCK_SIZE
    W = rng.standard_normal((out_dim, in_dim)) * np.exp(rng.uniform(-3, 3, (out_dim, in_dim)))
    W *= 10.0**log_scale
    W[rng.random(W.shape) < zero_fraction] = 0
    W = W.astype(np.float32)
    q = quantize_nvfp4(W)
    assert q.weight.shape == (out_dim, in_dim // 2) and q.weight.dtype == np.uint8
    assert q.weight_scale.shape == (out_dim, blocks) and q.weight_scale.dtype == F8
    assert q.shape == W.shape
    D_ = dequantize_nvfp4(q)
    assert np.isfinite(D_).all()
    assert (np.abs(W - D_) <= nvfp4_error_bound(W, q)).all()
    # Zeros stay zero and signs never flip.
    assert (D_[W == 0] == 0).all()
    assert (np.sign(D_) * np.sign(W) >= 0).all()


def test_gemma_sized_matrix_round_trips_within_bound():
    # Speed is a benchmark's business; here only that a real-sized weight is handled.
    W = np.random.default_rng(5).standard_normal((6912, 1152)).astype(np.float32)
    q = quantize_nvfp4(W)
    assert (np.abs(W - dequantize_nvfp4(q)) <= nvfp4_error_bound(W, q)).all()
