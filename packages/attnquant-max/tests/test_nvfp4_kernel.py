"""The NVFP4 reference of attnquant-kernels' tests agrees with attnquant-max's, bit for bit.

``attnquant_kernels.testing.nvfp4_dequantize`` is the reference the ``generated_linear_nvfp4``
op is tested against (attnquant-kernels cannot import attnquant-max); here both rebuild the same
quantized weights. No graph is compiled.
"""

from __future__ import annotations

import numpy as np
import pytest

from attnquant_kernels.testing import nvfp4_dequantize, nvfp4_random
from attnquant_max import dequantize_nvfp4, quantize_nvfp4


@pytest.mark.parametrize(("out_dim", "in_dim"), [(1, 16), (7, 48), (64, 256)])
def test_kernel_reference_dequantizes_like_attnquant_max(out_dim: int, in_dim: int):
    rng = np.random.default_rng(out_dim * in_dim)
    W = rng.standard_normal((out_dim, in_dim)).astype(np.float32)
    W[:, :16] *= 1e-3  # a block with a small scale (subnormal E4M3 range)
    q = quantize_nvfp4(W)
    ours = nvfp4_dequantize(q.weight, q.weight_scale.view(np.uint8), q.weight_scale_2)
    np.testing.assert_array_equal(ours, dequantize_nvfp4(q))


def test_random_packed_weights_are_a_valid_nvfp4_tensor():
    import ml_dtypes

    from attnquant_max import NVFP4Tensor

    weight, scale, scale_2 = nvfp4_random(np.random.default_rng(0), 5, 32)
    q = NVFP4Tensor(
        weight=weight,
        weight_scale=scale.view(ml_dtypes.float8_e4m3fn),
        weight_scale_2=scale_2.reshape(()),
    )
    np.testing.assert_array_equal(nvfp4_dequantize(weight, scale, scale_2), dequantize_nvfp4(q))
