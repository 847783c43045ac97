"""``--quant-embedding``: an embedding lookup over NVFP4 rows is exactly the reference's rows.

:func:`attnquant_max._nvfp4_graph.gather_nvfp4_rows` gathers the packed bytes and scales of the
rows asked for, row-major or in the tiled layout a fused CPU model holds (the tied head's bytes),
and decodes them in the graph. Here one small graph (fixed shapes, cached) gathers every row of
a 40-row table, two whole tiles and 8 rows past them, in both layouts, against
:func:`attnquant_core.forms.dequantize_nvfp4`. The whole model with the embedding in NVFP4 is
served in test_nvfp4_kernel; the state and the plan are checked here without a graph.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from attnquant_core.forms import dequantize_nvfp4, quantize_nvfp4
from attnquant_kernels.layout import tile_nvfp4
from attnquant_max import ServingOptions, plan_serving

from .conftest import tiny_llama_tensors, write_tiny_llama

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROWS, HIDDEN = 40, 32  # two tiles of 16 rows, then 8 rows held row-major after them
NVFP4 = ServingOptions(path="precompute-outside", quant="nvfp4", nvfp4_kernel="dequantize")


def _table() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    W = rng.standard_normal((ROWS, HIDDEN)).astype(np.float32)
    W[3, :16] *= 1e-3  # a block with a small scale (subnormal E4M3 range)
    q = quantize_nvfp4(W, name="embed_tokens.weight")
    return q.weight, q.weight_scale.view(np.uint8), q.weight_scale_2.reshape(1), dequantize_nvfp4(q)


def test_gathered_nvfp4_rows_are_the_reference_rows_in_both_layouts() -> None:
    from max.driver import CPU, Buffer
    from max.dtype import DType
    from max.engine import InferenceSession
    from max.graph import DeviceRef, Graph, TensorType, ops

    from attnquant_max._nvfp4_graph import gather_nvfp4_rows

    weight, scale, scale_2, reference = _table()
    tiled_weight, tiled_scale = tile_nvfp4(weight, scale)
    assert not np.array_equal(tiled_weight, weight)  # the layouts differ: the test can fail
    ids = np.random.default_rng(1).permutation(np.r_[np.arange(ROWS), [39, 0, 17, 32]])
    ids = ids.astype(np.uint32)
    dev = DeviceRef.CPU()
    types = [
        TensorType(DType.uint32, [len(ids)], device=dev),
        TensorType(DType.uint8, [ROWS, HIDDEN // 2], device=dev),
        TensorType(DType.uint8, [ROWS, HIDDEN // 16], device=dev),
        TensorType(DType.float32, [1], device=dev),
        TensorType(DType.uint8, [ROWS, HIDDEN // 2], device=dev),
        TensorType(DType.uint8, [ROWS, HIDDEN // 16], device=dev),
    ]
    with Graph("aq_test_nvfp4_gather_40x32", input_types=types) as g:
        i, w, ws, ws2, tw, tws = (v.tensor for v in g.inputs)
        g.output(
            gather_nvfp4_rows(w, ws, ws2, i, DType.float32),
            gather_nvfp4_rows(tw, tws, ws2, i, DType.float32, tiled=True),
            gather_nvfp4_rows(tw, tws, ws2, ops.reshape(i, [4, -1]), DType.float32, tiled=True),
        )
    model = InferenceSession(devices=[CPU()]).load(g)
    arrays = [ids, weight, scale, scale_2, tiled_weight, tiled_scale]
    row_major, tiled, batched = (
        out.to_numpy() for out in model.execute(*(Buffer.from_numpy(a) for a in arrays))
    )
    np.testing.assert_array_equal(row_major, reference[ids])
    np.testing.assert_array_equal(tiled, reference[ids])
    np.testing.assert_array_equal(batched, reference[ids].reshape(4, -1, HIDDEN))


def test_quant_embedding_quantizes_the_embedding_table_beside_the_head(tiny_dense: Path) -> None:
    """Untied: ``embed_tokens.weight`` becomes the reference quantizer's three tensors under its
    own name, beside the head's; the plan and its start-up line say so."""
    plan = plan_serving(tiny_dense, replace(NVFP4, quant_head=True, quant_embedding=True))
    assert plan.head_nvfp4 and plan.embedding_nvfp4
    assert "ATTNQUANT_QUANT_EMBEDDING=1" in plan.describe()
    state = dict(plan.quantized_state())
    key = "model.embed_tokens.weight"
    q = quantize_nvfp4(tiny_llama_tensors()[key], name=key)
    np.testing.assert_array_equal(state[key], q.weight)
    np.testing.assert_array_equal(state[f"{key}_scale"], q.weight_scale.view(np.uint8))
    np.testing.assert_array_equal(state[f"{key}_scale_2"], q.weight_scale_2.reshape(1))
    assert "lm_head.weight_scale_2" in state


def test_a_tied_embedding_reads_the_heads_nvfp4_bytes(tmp_path: Path) -> None:
    """Tied: the head is quantized from the table and the float table is not handed on at all;
    the graph's lookup reads the head's bytes (held once)."""
    tensors = tiny_llama_tensors()
    del tensors["lm_head.weight"]
    path = write_tiny_llama(tmp_path / "tied", tensors, tie_word_embeddings=True)
    options = replace(NVFP4, quant_head=True, quant_embedding=True)
    state = dict(plan_serving(path, options).quantized_state())
    assert not [k for k in state if "embed_tokens" in k]
    q = quantize_nvfp4(tensors["model.embed_tokens.weight"], name="model.embed_tokens.weight")
    np.testing.assert_array_equal(state["lm_head.weight"], q.weight)


def test_quant_embedding_without_the_head_in_nvfp4_is_refused(tiny_dense: Path) -> None:
    with pytest.raises(NotImplementedError, match=r"--quant-embedding.*--quant-head"):
        plan_serving(tiny_dense, replace(NVFP4, quant_embedding=True))
