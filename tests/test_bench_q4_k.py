"""The Q4_K writer of ``benchmarks/synthetic_llama.py`` against the ``gguf`` package's reader.

The ``gguf`` package (a dependency of MAX) dequantizes llama.cpp's K-quants but cannot write
them; the benchmark writes ``Q4_K`` itself so that MAX's CPU ``q4_k`` path can be timed beside
NVFP4. Here its bytes go back through ``gguf.quants.dequantize``, the reader MAX's GGUF loader
is written against.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from synthetic_llama import QK_K, quantize_q4_k  # noqa: E402

Q4_K = gguf.GGMLQuantizationType.Q4_K
Q4_0 = gguf.GGMLQuantizationType.Q4_0


def _rel_rms(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.sqrt(np.mean((got - want) ** 2)) / np.sqrt(np.mean(want**2)))


@pytest.mark.parametrize("shape", [(1, 256), (7, 512), (64, 1024)])
def test_q4_k_reads_back_through_gguf_at_least_as_close_as_q4_0(shape: tuple[int, int]) -> None:
    """144 bytes per 256 weights, read back by gguf no further from W than gguf's own q4_0
    (18 bytes per 32: the same 4.5 bits) on Gaussian rows with a different scale each."""
    rng = np.random.default_rng(shape[0])
    W = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.01, 1, (shape[0], 1))
    W = W.astype(np.float32)
    blocks = quantize_q4_k(W)
    assert blocks.dtype == np.uint8 and blocks.shape == (shape[0], shape[1] // QK_K * 144)
    back = gguf.quants.dequantize(blocks, Q4_K)
    assert back.shape == W.shape
    q4_0 = gguf.quants.dequantize(gguf.quants.quantize(W, Q4_0), Q4_0)
    assert _rel_rms(back, W) <= _rel_rms(q4_0, W) < 0.1


def test_q4_k_keeps_zeros_and_every_value_within_a_step() -> None:
    """A zero row stays zero, and every value comes back within one step of its sub-block
    (its range over 15): half a step from the 4-bit codes, the rest from rounding the
    sub-block's scale and min to 6 bits."""
    rng = np.random.default_rng(3)
    W = rng.uniform(-1, 1, (4, 512)).astype(np.float32)
    W[1] = 0
    back = gguf.quants.dequantize(quantize_q4_k(W), Q4_K)
    np.testing.assert_array_equal(back[1], 0)
    sub = W.reshape(4, -1, 32)
    step = (sub.max(-1) - np.minimum(sub.min(-1), 0)) / 15
    err = np.abs(back - W).reshape(4, -1, 32).max(-1)
    assert (err <= step + 1e-6).all()


def test_q4_k_refuses_rows_that_are_not_whole_super_blocks() -> None:
    with pytest.raises(ValueError, match="multiple of 256 values, got 192"):
        quantize_q4_k(np.zeros((2, 192), np.float32))
