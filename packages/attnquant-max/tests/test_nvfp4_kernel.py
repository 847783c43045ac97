"""The NVFP4 reference of attnquant-kernels' tests agrees with attnquant-max's, bit for bit.

``attnquant_kernels.testing.nvfp4_dequantize`` is the reference the ``generated_linear_nvfp4``
op is tested against (attnquant-kernels cannot import attnquant-max); here both rebuild the same
quantized weights (no graph compiled). Then the served NVFP4 model with the fused op forced.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from attnquant_core.forms import dequantize_nvfp4, quantize_nvfp4
from attnquant_kernels.testing import nvfp4_dequantize, nvfp4_random
from attnquant_max.testing import VOCAB

from .conftest import HIDDEN, LAYERS, PROJECTIONS, tiny_llama_tensors


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

    from attnquant_core.forms import NVFP4Tensor

    weight, scale, scale_2 = nvfp4_random(np.random.default_rng(0), 5, 32)
    q = NVFP4Tensor(
        weight=weight,
        weight_scale=scale.view(ml_dtypes.float8_e4m3fn),
        weight_scale_2=scale_2.reshape(()),
    )
    np.testing.assert_array_equal(nvfp4_dequantize(weight, scale, scale_2), dequantize_nvfp4(q))


@pytest.mark.slow
@pytest.mark.xdist_group("nvfp4-fused")
def test_served_nvfp4_on_the_fused_op_is_the_stock_model_on_dequantized_weights(
    tiny_dense: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ATTNQUANT_QUANT=nvfp4`` with every projection and the head
    (``ATTNQUANT_QUANT_HEAD=1``) in ``generated_linear_nvfp4`` dispatches: q/k/v and gate/up
    one each over their merged weights (float32), o, down and the head one each. The model is
    tied and its embedding in NVFP4 too (``ATTNQUANT_QUANT_EMBEDDING=1``): the lookup gathers
    the head's packed rows, in the layout the head's op reads, so both are one 4-bit table.

    The start-up measurement (:func:`attnquant_max._nvfp4_layers.nvfp4_fused`) picks the
    faster form, which on the tiny model's 128x64 projections can be either; here the fused
    form is forced and must give the stock model on the numpy-dequantized weights. On the CPU
    the op serves every batch: the long prompt's forward (16 rows or more) runs its panel GEMM,
    each decode step its register tiles.
    """
    from attnquant_max._nvfp4_layers import NVFP4Linear
    from attnquant_max.architectures.llama3 import graph

    from .conftest import load_tiny, write_tiny_llama
    from .test_nvfp4_serving import NVFP4, PROMPTS, _dequantized_tensors, assert_serves_like

    calls = []
    kernel_call = NVFP4Linear.kernel_call

    def measured(*args: Any) -> bool:
        raise AssertionError("ATTNQUANT_NVFP4_KERNEL=fused must not time the two forms")

    def counted(self: NVFP4Linear, x: Any) -> Any:
        calls.append((self.out_dim, self.in_dim))
        return kernel_call(self, x)

    monkeypatch.setattr(graph, "nvfp4_fused", measured)  # --nvfp4-kernel fused: never timed
    monkeypatch.setattr(NVFP4Linear, "kernel_call", counted)
    tied = tiny_llama_tensors()
    del tied["lm_head.weight"]
    tied_dir = write_tiny_llama(tmp_path / "tied", tied, tie_word_embeddings=True)
    # The reference is untied (the stock graph the other tests compile), both tables the
    # dequantized one: the same function as the tied model on it.
    tensors = _dequantized_tensors()
    table = dequantize_nvfp4(quantize_nvfp4(tied["model.embed_tokens.weight"]))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] = table
    reference_dir = write_tiny_llama(tmp_path / "dequantized", tensors)
    fused = replace(
        NVFP4, nvfp4_kernel="fused", quant_head=True, quant_embedding=True, nvfp4_int8=False
    )
    qkv = sum(PROJECTIONS[f"self_attn.{p}_proj"][0] for p in "qkv")
    gate_up = sum(PROJECTIONS[f"mlp.{p}_proj"][0] for p in ("gate", "up"))
    with load_tiny(tied_dir, fused) as model, load_tiny(reference_dir) as reference:
        pm = model.model.pipeline._pipeline_model
        assert not [k for k in pm.state_dict if "embed_tokens" in k]  # one table: the head's
        # float32: q/k/v and gate/up one merged dispatch each, o, down and the head one each
        per_forward = LAYERS * (len(PROJECTIONS) - 3) + 1
        assert calls and len(calls) % per_forward == 0
        forwards = len(calls) // per_forward
        assert calls.count((VOCAB, HIDDEN)) == forwards
        assert calls.count((qkv, HIDDEN)) == calls.count((gate_up, HIDDEN)) == LAYERS * forwards
        long = "The quick brown fox jumps over the lazy dog."
        assert 16 <= len(reference.encode(long)) <= 64 - 8  # the op's panel GEMM from 16 rows
        assert_serves_like(model, reference, [*PROMPTS, long])


@pytest.mark.slow
@pytest.mark.xdist_group("nvfp4-fused")
def test_start_up_measurement_checks_the_fused_op_and_logs_the_choice(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The tiny model's gate_proj shape: the graphs the served NVFP4 model's start-up compiles."""
    import logging

    from max.graph import DeviceRef

    from attnquant_max._nvfp4_layers import nvfp4_fused

    with caplog.at_level(logging.INFO, logger="attnquant_max._nvfp4_layers"):
        choice = nvfp4_fused.__wrapped__(DeviceRef.CPU(), 128, 64)  # uncached: measure again
    (line,) = [r.getMessage() for r in caplog.records if "NVFP4 projections" in r.getMessage()]
    expected = "fused generated_linear_nvfp4" if choice else "dequantized in the graph"
    assert line.startswith(f"NVFP4 projections on cpu:0: {expected}")
    assert "on one 128x64 projection, batch 1" in line
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # outputs agree


@pytest.mark.slow
@pytest.mark.xdist_group("nvfp4-fused")
def test_int8_decode_steps_stay_within_their_rounding_of_the_float_op(
    tiny_dense: Path, tmp_path: Path
) -> None:
    """``--nvfp4-int8``: every projection rounds its activations to int8 per group of 64 and
    multiplies integers, in decode steps (one row) and in the prompt's forward alike, so the
    int8 model's decode steps score as its whole prefixes do (each row is rounded on its own).
    Scored through decode steps (:func:`attnquant_max.decode_logprobs`) against the same model
    on the float op, int8 must move the scores by less than a quarter of what the 4-bit weights
    already move them from the dense model (measured: 0.032 against 0.93 nats, the table in
    NVFP4 too; docs/decode-speed.md), and must have run (the scores differ) where the tiled
    layout serves it; elsewhere the float op serves, identically.

    The embedding is in NVFP4 too (``--quant-embedding``, untied: its own table, tiled at load
    as the projections are), and the float model is first checked to be exactly the stock model
    on the dequantized weights, table included."""
    from attnquant_kernels.layout import cpu_prefers_tiled
    from attnquant_max import decode_logprobs, greedy_generate, greedy_logprobs

    from .conftest import load_tiny, write_tiny_llama
    from .test_nvfp4_serving import NVFP4, PROMPTS, _dequantized_tensors, assert_serves_like

    fused = replace(
        NVFP4, nvfp4_kernel="fused", quant_head=True, quant_embedding=True, nvfp4_int8=False
    )
    int8 = replace(fused, nvfp4_int8=True)  # the default
    long = "The quick brown fox jumps over the lazy dog."
    tensors = _dequantized_tensors()
    for key in ("lm_head.weight", "model.embed_tokens.weight"):
        tensors[key] = dequantize_nvfp4(quantize_nvfp4(tensors[key]))
    reference_dir = write_tiny_llama(tmp_path / "dequantized", tensors)
    with (
        load_tiny(tiny_dense) as dense,
        load_tiny(tiny_dense, fused) as model,
        load_tiny(tiny_dense, int8) as quantized,
    ):
        with load_tiny(reference_dir) as reference:
            assert_serves_like(model, reference, [*PROMPTS, long])
        worst, weights = 0.0, 0.0
        for prompt in [*PROMPTS, long]:
            ids = model.encode(prompt)
            tokens = greedy_generate(model, ids, 8)
            steps = decode_logprobs(model, ids, tokens).logprobs
            # the float op's single-row tiles and its prompt forward compute the same sums
            whole = greedy_logprobs(model, ids, tokens).logprobs
            np.testing.assert_allclose(steps, whole, rtol=0, atol=1e-4)
            got = decode_logprobs(quantized, ids, tokens).logprobs
            got_whole = greedy_logprobs(quantized, ids, tokens).logprobs
            np.testing.assert_allclose(got, got_whole, rtol=0, atol=1e-4)
            worst = max(worst, float(np.abs(got - steps).max()))
            stock = decode_logprobs(dense, ids, tokens).logprobs
            weights = max(weights, float(np.abs(steps - stock).max()))
    print(f"max |dlogp|, decode steps: int8 vs float {worst:.3g}, NVFP4 vs dense {weights:.3g}")
    if cpu_prefers_tiled():
        assert 0.0 < worst < 0.25 * weights, (worst, weights)
    else:
        assert worst == 0.0
