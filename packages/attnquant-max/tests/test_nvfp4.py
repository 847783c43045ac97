"""NVFP4 in attnquant-max: the re-export of core's reference, and MAX's own host encoder agreeing.

The reference itself (known values, rounding and scale rules, refusals, error bound) is tested
in attnquant-core (``packages/attnquant-core/tests/test_nvfp4.py``), where it now lives.
"""

from __future__ import annotations

import numpy as np
import pytest

import attnquant_core.forms as core_nvfp4
import attnquant_max
from attnquant_max import _nvfp4
from attnquant_max._nvfp4 import dequantize_nvfp4, quantize_nvfp4


def test_max_re_exports_core_objects():
    """``attnquant_max`` and its ``_nvfp4`` hand out the very objects core defines."""
    for name in _nvfp4.__all__:
        assert getattr(_nvfp4, name) is getattr(core_nvfp4, name), name
    for name in ("NVFP4Error", "NVFP4Tensor", "quantize_nvfp4", "dequantize_nvfp4"):
        assert getattr(attnquant_max, name) is getattr(core_nvfp4, name), name


# -- agreement with MAX's own host encoder -----------------------------------------------------


def test_matches_max_host_encoder_bit_for_bit():
    """MAX 26.7 ships a numpy NVFP4 encoder for its offline requantizer; ours writes the same bytes.

    (It differs only where modelopt's rules are explicit and MAX's are not exercised here: an
    all-zero block gets scale 1.0 from modelopt, 0 from MAX; a tiny block is clamped to 2**-9.)
    """
    fp4 = pytest.importorskip("max.pipelines.weights.fp4_quantization")
    rng = np.random.default_rng(6)
    W = (rng.standard_t(4, (96, 320)) * 0.02).astype(np.float32)
    packed, scales, decode_scale = fp4.quantize_nvfp4(W, fp4.FP4Format.NVFP4)
    q = quantize_nvfp4(W)
    np.testing.assert_array_equal(q.weight, packed)
    np.testing.assert_array_equal(q.weight_scale.view(np.uint8), scales.squeeze(-1))
    assert q.weight_scale_2 == np.float32(decode_scale)
    theirs = fp4.dequantize_nvfp4(packed, scales, decode_scale, fp4.FP4Format.NVFP4)
    np.testing.assert_allclose(dequantize_nvfp4(q), theirs, rtol=1e-6, atol=0)
