"""NVFP4 in attnquant-max: the re-export of core's reference, and MAX's own host encoder agreeing.

The reference itself (known values, rounding and scale rules, refusals, error bound) is tested
in attnquant-core (``packages/attnquant-core/tests/test_nvfp4.py``), where it now lives.
"""

from __future__ import annotations

import numpy as np
import pytest

import attnquant_core.forms as core_nvfp4
import attnquant_core.io as core_io
import attnquant_core.serving as core_serving
import attnquant_max
from attnquant_core.forms import dequantize_nvfp4, quantize_nvfp4


def test_max_re_exports_core_objects():
    """``attnquant_max`` hands out the very objects core defines (its public API kept)."""
    nvfp4 = ("BLOCK_SIZE", "E2M1_VALUES", "E4M3_VALUES", "NVFP4Error", "NVFP4Tensor")
    nvfp4 += ("dequantize_nvfp4", "nvfp4_error_bound", "quantize_nvfp4")
    for name in nvfp4:
        assert getattr(attnquant_max, name) is getattr(core_nvfp4, name), name
    for name in ("ExportProgress", "export_nvfp4"):
        assert getattr(attnquant_max, name) is getattr(core_io, name), name
    for name in ("InGraphLayout", "ingraph_tensors", "ServingOptions"):
        assert getattr(attnquant_max, name) is getattr(core_serving, name), name


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
