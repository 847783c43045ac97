"""NVFP4 in numpy: the reference quantizer and dequantizer of NVIDIA Model Optimizer's layout.

The 4-bit ``W0`` of a quantized banded family (:class:`~attnquant_core.FamilyTheta` with
``nvfp4``) is stored this way, and ``attnquant export --format nvfp4`` / the in-graph NVFP4 path
of attnquant-max use the same functions (re-exported there).

NVFP4 stores a weight ``W`` (``[out, in]``) as

* ``weight`` (uint8 ``[out, in/2]``): one 4-bit E2M1 code per element, two per byte, the even
  element of each pair in the low nibble. A code is ``S EE M``: sign bit 3, then the magnitude
  index 0..7 into ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}``.
* ``weight_scale`` (float8_e4m3fn ``[out, in/16]``): one scale per 16 consecutive inputs.
* ``weight_scale_2`` (float32 scalar): ``amax(|W|) / (6 * 448)``, so the largest block's scale
  lands on 448, the largest finite E4M3 value.

and rebuilds it as ``W[o, i] ~= E2M1[code[o, i]] * float(weight_scale[o, i // 16]) *
weight_scale_2``. The steps below follow ``NVFP4QTensor`` in modelopt
(``modelopt/torch/quantization/qtensor/nvfp4_tensor.py``: ``get_weights_scaling_factor_2``,
``get_weights_scaling_factor``, ``quantize``, ``_cast_fp4``), which MAX's modelopt loader reads
unchanged; the arithmetic is float32 throughout, in the same order.

Rounding to E2M1 is round-to-nearest, ties to even, where "even" is the code whose mantissa bit
(bit 0) is 0. The midpoints are ``0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5``; a value exactly on one
goes to ``0, 1, 1, 2, 2, 4, 4`` respectively (codes 0, 2, 2, 4, 4, 6, 6). modelopt's
``_cast_fp4`` does this with ``searchsorted`` (a tie lands on the lower code) plus one where the
value equals the bounds at odd positions ``0.75, 1.75, 3.5``; MAX's host encoder
(``max/pipelines/weights/fp4_quantization.py``, ``round_to_e2m1``) uses ``<=`` at even-position
bounds and ``<`` at odd ones: the same rule, which is IEEE round-half-to-even on the E2M1 grid.
Magnitudes above 6 saturate to 6. A negative value that rounds to zero keeps its sign bit
(code 8), as both references produce.

References
----------
NVIDIA, "Introducing NVFP4 for efficient and accurate low-precision inference", 2025.
OCP Microscaling Formats (MX) v1.0 specification, section 5.3.3 (FP4 E2M1).
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from .._errors import AttnquantError

__all__ = [
    "BLOCK_SIZE",
    "E2M1_MAX",
    "E2M1_VALUES",
    "E4M3_MAX",
    "E4M3_MIN_SUBNORMAL",
    "E4M3_VALUES",
    "NVFP4Error",
    "NVFP4Tensor",
    "check_nvfp4_shape",
    "dequantize_nvfp4",
    "e2m1_codes",
    "nvfp4_error_bound",
    "pack_nibbles",
    "quantize_nvfp4",
    "unpack_nibbles",
]

#: Inputs that share one E4M3 block scale.
BLOCK_SIZE = 16
#: Largest E2M1 magnitude.
E2M1_MAX = 6.0
#: Largest finite float8_e4m3fn value; block scales saturate here.
E4M3_MAX = 448.0
#: Smallest positive float8_e4m3fn value (a subnormal); tiny nonzero block scales clamp up to it.
E4M3_MIN_SUBNORMAL = 2.0**-9

#: The value of each 4-bit E2M1 code (index = code). Code 8 is negative zero, decoded as 0.
E2M1_VALUES = np.array(
    [0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32
)
#: The value of each float8_e4m3fn byte (index = byte) as float32; 0x7F and 0xFF are NaN.
E4M3_VALUES = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)

_F32 = np.float32
_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
# The float dtypes numpy does not call kind 'f' (ml_dtypes'); forms cannot import io's is_float.
_ML_FLOATS = (np.dtype(ml_dtypes.bfloat16), _E4M3, np.dtype(ml_dtypes.float8_e5m2))
# Midpoints between consecutive E2M1 magnitudes. A tie at an even position (0.25, 1.25, 2.5, 5)
# rounds down to the even code below it; a tie at an odd position (0.75, 1.75, 3.5) rounds up
# to the even code above it.
_TIE_DOWN = (_F32(0.25), _F32(1.25), _F32(2.5), _F32(5.0))
_TIE_UP = (_F32(0.75), _F32(1.75), _F32(3.5))


class NVFP4Error(AttnquantError, ValueError):
    """A tensor cannot be stored as NVFP4 (shape, dtype or non-finite values)."""


@dataclass(frozen=True, kw_only=True)
class NVFP4Tensor:
    """One weight in modelopt's NVFP4 layout; the fields are the checkpoint tensors.

    Attributes
    ----------
    weight : ndarray of uint8, shape (out, in / 2)
        Packed E2M1 codes, the even input of each pair in the low nibble.
    weight_scale : ndarray of float8_e4m3fn, shape (out, in / 16)
        One scale per 16 consecutive inputs.
    weight_scale_2 : ndarray of float32, shape ()
        The per-tensor scale, ``amax / (6 * 448)``.
    """

    weight: np.ndarray
    weight_scale: np.ndarray
    weight_scale_2: np.ndarray

    def __post_init__(self) -> None:
        w, s, s2 = self.weight, self.weight_scale, self.weight_scale_2
        if w.dtype != np.uint8 or w.ndim != 2:
            raise NVFP4Error(f"weight must be 2-D uint8, got {w.dtype}{list(w.shape)}")
        if s.dtype != _E4M3 or s.ndim != 2:
            raise NVFP4Error(
                f"weight_scale must be 2-D float8_e4m3fn, got {s.dtype}{list(s.shape)}"
            )
        if s2.dtype != np.float32 or s2.shape != ():
            raise NVFP4Error(
                f"weight_scale_2 must be a float32 scalar, got {s2.dtype}{list(s2.shape)}"
            )
        out_dim, half = w.shape
        if s.shape != (out_dim, 2 * half // BLOCK_SIZE) or (2 * half) % BLOCK_SIZE:
            raise NVFP4Error(
                f"weight {list(w.shape)} packs {2 * half} inputs per row, which needs "
                f"weight_scale [{out_dim}, {2 * half // BLOCK_SIZE}], got {list(s.shape)}"
            )

    @property
    def shape(self) -> tuple[int, int]:
        """Shape ``(out, in)`` of the dense weight."""
        return int(self.weight.shape[0]), 2 * int(self.weight.shape[1])

    @property
    def nbytes(self) -> int:
        """Bytes of the three tensors together."""
        return self.weight.nbytes + self.weight_scale.nbytes + self.weight_scale_2.nbytes

    def tensors(self, prefix: str) -> dict[str, np.ndarray]:
        """The checkpoint keys of a module ``prefix`` (``model.layers.0.mlp.up_proj``)."""
        return {
            f"{prefix}.weight": self.weight,
            f"{prefix}.weight_scale": self.weight_scale,
            f"{prefix}.weight_scale_2": self.weight_scale_2,
        }


def check_nvfp4_shape(shape: tuple[int, ...], *, name: str = "weight") -> None:
    """Raise :class:`NVFP4Error` naming ``name`` unless ``shape`` is ``(out, in)`` with ``in % 16 == 0``."""
    shape = tuple(shape)
    if len(shape) != 2:
        raise NVFP4Error(f"{name}: NVFP4 quantizes 2-D weights, got shape {list(shape)}")
    in_dim = shape[1]
    if in_dim % BLOCK_SIZE:
        raise NVFP4Error(
            f"{name}: inner dimension {in_dim} (shape {list(shape)}) is not a multiple of "
            f"{BLOCK_SIZE}; NVFP4 needs whole {BLOCK_SIZE}-input blocks. Leave this tensor "
            f"unquantized or pad its input dimension to {-(-in_dim // BLOCK_SIZE) * BLOCK_SIZE}"
        )


def _as_float32_matrix(W: np.ndarray, name: str) -> np.ndarray:
    W = np.asarray(W)
    check_nvfp4_shape(W.shape, name=name)
    if not (W.dtype.kind == "f" or W.dtype in _ML_FLOATS):
        raise NVFP4Error(f"{name}: cannot quantize dtype {W.dtype} to NVFP4; expected a float")
    W = W.astype(np.float32, copy=False)  # exact for bf16/f16; modelopt also works in float32
    finite = np.isfinite(W)
    if not finite.all():
        bad = int(W.size - np.count_nonzero(finite))
        raise NVFP4Error(f"{name}: holds {bad} NaN/Inf values; refusing to quantize to NVFP4")
    return W


def e2m1_codes(x: np.ndarray) -> np.ndarray:
    """Round float32 values (already divided by their scale) to 4-bit E2M1 codes.

    Nearest E2M1 value, ties to the even code, saturating at 6; bit 3 is set for ``x < 0``.

    Parameters
    ----------
    x : ndarray of float32
        Finite values; any shape.

    Returns
    -------
    codes : ndarray of uint8, same shape as ``x``
        Values 0..15.
    """
    a = np.abs(x)
    # The magnitude index counts the midpoints below the value: strictly below for a midpoint
    # whose tie rounds down, at or below for one whose tie rounds up. Each tie lands on an even
    # index.
    mag = np.zeros(a.shape, np.uint8)
    for bound in _TIE_DOWN:
        mag += a > bound
    for bound in _TIE_UP:
        mag += a >= bound
    return mag | ((x < 0).astype(np.uint8) << 3)


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """Pack 4-bit codes ``[..., 2n]`` into bytes ``[..., n]``: element ``2j`` in the low nibble."""
    codes = np.asarray(codes, np.uint8)
    if codes.shape[-1] % 2:
        raise NVFP4Error(f"cannot pack an odd number of codes per row ({codes.shape[-1]})")
    return (codes[..., 0::2] & 0x0F) | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """The inverse of :func:`pack_nibbles`: bytes ``[..., n]`` to codes ``[..., 2n]``."""
    packed = np.asarray(packed, np.uint8)
    codes = np.empty((*packed.shape[:-1], 2 * packed.shape[-1]), np.uint8)
    codes[..., 0::2] = packed & 0x0F
    codes[..., 1::2] = packed >> 4
    return codes


def _tensor_scale(W: np.ndarray) -> np.float32:
    """``weight_scale_2 = amax / (6 * 448)``; an all-zero tensor is treated as if ``amax = 1``.

    modelopt would divide 0 by 0 there and write NaN scales; any positive value gives the same
    (all-zero) dequantized tensor, and 1/2688 keeps every later division finite.
    """
    amax = _F32(np.max(np.abs(W))) if W.size else _F32(0)
    if amax == 0:
        amax = _F32(1)
    return _F32(amax / _F32(E2M1_MAX * E4M3_MAX))


def _block_scales(
    W: np.ndarray, scale_2: np.float32, factor: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """E4M3 block scales ``[out, in/16]`` and the unrounded float32 scales they come from;
    ``factor`` scales the unrounded scales before rounding (GPTQ's scale search tries a few)."""
    out_dim, in_dim = W.shape
    block_amax = np.abs(W.reshape(out_dim, in_dim // BLOCK_SIZE, BLOCK_SIZE)).max(axis=-1)
    # modelopt: per_block_amax / (6 * weights_scaling_factor_2), in float32.
    raw = block_amax / (_F32(E2M1_MAX) * scale_2)
    # An all-zero block gets scale 1.0 (modelopt's rule: any scale works, its codes are all 0).
    # A tiny nonzero block clamps up to the smallest E4M3 subnormal instead of underflowing to
    # a zero scale. The top clamp only catches float32 rounding above 448: E4M3 has no infinity
    # and ml_dtypes (like torch) turns values past the largest finite code into NaN.
    scale = np.where(raw == 0, _F32(1), raw * _F32(factor))
    scale = np.clip(scale, _F32(E4M3_MIN_SUBNORMAL), _F32(E4M3_MAX))
    return scale.astype(_E4M3), raw  # round to nearest even, as torch's .to(float8_e4m3fn)


def quantize_nvfp4(W: np.ndarray, *, name: str = "weight") -> NVFP4Tensor:
    """Quantize a weight to NVFP4 exactly as modelopt's ``NVFP4QTensor.quantize`` does.

    Parameters
    ----------
    W : ndarray, shape (out, in)
        Finite weight in any float dtype (bfloat16 through ``ml_dtypes``); ``in`` must be a
        multiple of 16. Computed in float32 (exact for bf16 and float16 inputs).
    name : str, default="weight"
        Named in every error, e.g. the checkpoint key.

    Returns
    -------
    NVFP4Tensor
        ``weight`` uint8 ``(out, in/2)``, ``weight_scale`` float8_e4m3fn ``(out, in/16)``,
        ``weight_scale_2`` float32 ``()``.

    Raises
    ------
    NVFP4Error
        (a ``ValueError``) for a non-2-D weight, an inner dimension that is not a multiple of
        16, or NaN/Inf values.
    """
    W = _as_float32_matrix(W, name)
    out_dim, in_dim = W.shape
    # 1. Per-tensor scale: the largest |W| maps to 6 * 448.
    scale_2 = _tensor_scale(W)
    # 2. Per-block scales relative to it, rounded to E4M3.
    scale, _ = _block_scales(W, scale_2)
    # 3. Divide each block by its dequantized scale (float32 product first, as modelopt does),
    #    round to E2M1 and pack two codes per byte.
    step = scale.astype(np.float32) * scale_2
    scaled = W.reshape(out_dim, in_dim // BLOCK_SIZE, BLOCK_SIZE) / step[..., None]
    codes = e2m1_codes(scaled).reshape(out_dim, in_dim)
    del scaled
    return NVFP4Tensor(
        weight=pack_nibbles(codes),
        weight_scale=scale,
        weight_scale_2=np.asarray(scale_2, np.float32).reshape(()),
    )


def dequantize_nvfp4(q: NVFP4Tensor, dtype: np.dtype | type = np.float32) -> np.ndarray:
    """Rebuild the dense weight: ``E2M1[code] * (float32(weight_scale) * weight_scale_2)``.

    Parameters
    ----------
    q : NVFP4Tensor
    dtype : dtype, default=np.float32
        Output dtype; the arithmetic is float32 whatever it is.

    Returns
    -------
    W : ndarray, shape (out, in)
    """
    out_dim, in_dim = q.shape
    values = E2M1_VALUES[unpack_nibbles(q.weight)]
    step = q.weight_scale.astype(np.float32) * q.weight_scale_2
    W = values.reshape(out_dim, in_dim // BLOCK_SIZE, BLOCK_SIZE) * step[..., None]
    return W.reshape(out_dim, in_dim).astype(dtype, copy=False)


def nvfp4_error_bound(W: np.ndarray, q: NVFP4Tensor) -> np.ndarray:
    """Per-element bound on ``|W - dequantize_nvfp4(q)|`` for ``q = quantize_nvfp4(W)``.

    With ``d`` the dequantized step of the element's block (``float(weight_scale) *
    weight_scale_2``) and ``a = |w| / d``:

    * rounding to the nearest E2M1 value costs at most half the grid spacing around ``a``:
      ``0.25`` for ``a <= 2`` (spacing 0.5), ``0.5`` for ``a <= 4`` (spacing 1), ``1`` above
      (spacing 2), times ``d``;
    * rounding the block scale down to E4M3 can push ``a`` past 6, where it saturates; the extra
      error is at most ``6 * weight_scale_2 * (s - float(weight_scale))`` with ``s`` the
      unrounded scale (for a normal E4M3 scale ``a <= 6 / (1 - 2**-4) = 6.4``, so the half
      spacing of 1 above 4 already covers it);
    * float32 arithmetic adds a few ulps of ``|w|`` and ``d``.

    Returns
    -------
    bound : ndarray of float32, shape (out, in)
    """
    W = np.asarray(W).astype(np.float32)
    out_dim, in_dim = W.shape
    scale_2 = _F32(q.weight_scale_2)
    d = (q.weight_scale.astype(np.float32) * scale_2)[..., None]
    _, raw = _block_scales(W, scale_2)
    blocks = np.abs(W.reshape(out_dim, in_dim // BLOCK_SIZE, BLOCK_SIZE))
    a = blocks / d
    half_step = _F32(0.25) * np.exp2((a > 2).astype(np.float32) + (a > 4))
    clipped = _F32(E2M1_MAX) * scale_2 * np.maximum(raw - q.weight_scale.astype(np.float32), 0)
    ulps = _F32(4 * np.finfo(np.float32).eps) * (blocks + _F32(E2M1_MAX) * d)
    bound = half_step * d + clipped[..., None] + ulps
    return bound.reshape(out_dim, in_dim).astype(np.float32)
