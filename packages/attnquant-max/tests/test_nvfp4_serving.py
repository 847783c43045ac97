"""``ATTNQUANT_QUANT=nvfp4`` at load: packed weights, dequantized inside the graph, on the CPU.

The served NVFP4 model must be *exactly* the stock model run on the dequantized weights of the
numpy reference: any slip in nibble order, scale layout or arithmetic shows up there. How far
NVFP4 moves the model from float32 is a measurement (``attnquant verify``), not asserted here.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from attnquant_core.forms import (
    BLOCK_SIZE,
    NVFP4Error,
    dequantize_nvfp4,
    quantize_nvfp4,
)
from attnquant_max import (
    LoadedModel,
    ServingOptions,
    greedy_generate,
    greedy_logprobs,
    plan_serving,
)
from attnquant_max._describe import NVFP4_HEAD
from attnquant_max._nvfp4_layers import E2M1_PAIR_TABLE

from .conftest import LAYERS, PROJECTIONS, load_tiny, tiny_llama_tensors, write_tiny_llama

pytestmark = pytest.mark.xdist_group("nvfp4")  # one worker loads the NVFP4 model

# The dequantize-in-graph form, chosen explicitly so that CI compiles one known graph (auto
# times both at start-up and may pick either on the tiny shapes); test_nvfp4_kernel forces fused.
NVFP4 = ServingOptions(path="precompute-outside", quant="nvfp4", nvfp4_kernel="dequantize")
PROMPTS = ["hello world", "The quick brown fox"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MAX_SERVE_DISABLE_TELEMETRY", "1")


def _dequantized_tensors() -> dict[str, np.ndarray]:
    """The tiny Llama with every projection replaced by its NVFP4 round trip (numpy reference)."""
    tensors = tiny_llama_tensors()
    for key in list(tensors):
        if any(key.endswith(f"{family}.weight") for family in PROJECTIONS):
            tensors[key] = dequantize_nvfp4(quantize_nvfp4(tensors[key], name=key))
    return tensors


def test_pair_table_decodes_both_nibbles() -> None:
    from attnquant_core.forms import E2M1_VALUES, unpack_nibbles

    packed = np.arange(256, dtype=np.uint8).reshape(16, 16)
    codes = unpack_nibbles(packed)  # [16, 32], even element from the low nibble
    np.testing.assert_array_equal(
        E2M1_PAIR_TABLE[packed].reshape(16, 32), E2M1_VALUES[codes].reshape(16, 32)
    )


def test_quantized_state_layout(tiny_dense: Path) -> None:
    plan = plan_serving(tiny_dense, NVFP4)
    assert plan.quantized and plan.rebuilds and not plan.in_graph
    assert "ATTNQUANT_QUANT=nvfp4" in plan.describe() and "dequantized inside the graph" in (
        plan.describe()
    )
    state = dict(plan.quantized_state())
    dense = tiny_llama_tensors()
    for key, W in dense.items():
        family = next((f for f in PROJECTIONS if key.endswith(f"{f}.weight")), None)
        if family is None:
            np.testing.assert_array_equal(state[key], W)
            continue
        out_dim, in_dim = W.shape
        prefix = key[: -len(".weight")]
        packed, scale, scale_2 = (
            state[key],
            state[f"{prefix}.weight_scale"],
            state[f"{prefix}.weight_scale_2"],
        )
        assert (packed.dtype, packed.shape) == (np.uint8, (out_dim, in_dim // 2))
        assert (scale.dtype, scale.shape) == (np.uint8, (out_dim, in_dim // BLOCK_SIZE))
        assert (scale_2.dtype, scale_2.shape) == (np.float32, (1,))
        q = quantize_nvfp4(W)
        np.testing.assert_array_equal(packed, q.weight)
        np.testing.assert_array_equal(scale, q.weight_scale.view(np.uint8))
    extra = set(state) - set(dense)
    assert len(extra) == 2 * len(PROJECTIONS) * LAYERS  # two scales per projection and layer


def test_quantized_state_refuses_an_inner_size_not_a_multiple_of_16(tmp_path: Path) -> None:
    tensors = tiny_llama_tensors()
    # A 1-row-short MLP: down_proj's inner size 120 is not a multiple of 16.
    for i in range(LAYERS):
        p = f"model.layers.{i}.mlp."
        tensors[p + "gate_proj.weight"] = tensors[p + "gate_proj.weight"][:120]
        tensors[p + "up_proj.weight"] = tensors[p + "up_proj.weight"][:120]
        tensors[p + "down_proj.weight"] = np.ascontiguousarray(
            tensors[p + "down_proj.weight"][:, :120]
        )
    path = write_tiny_llama(tmp_path / "odd", tensors, intermediate_size=120)
    with pytest.raises(NVFP4Error, match=r"model\.layers\.0\.mlp\.down_proj\.weight.*16"):
        dict(plan_serving(path, NVFP4).quantized_state())


def test_quantized_state_quantizes_the_head_with_quant_head(tiny_dense: Path) -> None:
    """``ATTNQUANT_QUANT_HEAD=1``: ``lm_head.weight`` is three NVFP4 tensors like a projection's
    (the reference quantizer's bytes), the embedding and norms unchanged; the plan says so."""
    plan = plan_serving(tiny_dense, replace(NVFP4, quant_head=True))
    assert plan.head_nvfp4 and "ATTNQUANT_QUANT_HEAD=1" in plan.describe()
    assert not plan_serving(tiny_dense, NVFP4).head_nvfp4
    state = dict(plan.quantized_state())
    dense = tiny_llama_tensors()
    q = quantize_nvfp4(dense["lm_head.weight"], name="lm_head.weight")
    np.testing.assert_array_equal(state["lm_head.weight"], q.weight)
    np.testing.assert_array_equal(state["lm_head.weight_scale"], q.weight_scale.view(np.uint8))
    np.testing.assert_array_equal(state["lm_head.weight_scale_2"], q.weight_scale_2.reshape(1))
    np.testing.assert_array_equal(
        state["model.embed_tokens.weight"], dense["model.embed_tokens.weight"]
    )
    np.testing.assert_array_equal(state["model.norm.weight"], dense["model.norm.weight"])


def test_a_tied_head_is_quantized_from_the_embedding_table(tmp_path: Path) -> None:
    tensors = tiny_llama_tensors()
    del tensors["lm_head.weight"]
    path = write_tiny_llama(tmp_path / "tied", tensors, tie_word_embeddings=True)
    state = dict(plan_serving(path, replace(NVFP4, quant_head=True)).quantized_state())
    table = tensors["model.embed_tokens.weight"]
    np.testing.assert_array_equal(state["model.embed_tokens.weight"], table)  # float, as stored
    q = quantize_nvfp4(table, name="model.embed_tokens.weight")
    np.testing.assert_array_equal(state["lm_head.weight"], q.weight)
    np.testing.assert_array_equal(state["lm_head.weight_scale"], q.weight_scale.view(np.uint8))


def test_quant_head_in_the_stock_graph_is_refused(tiny_dense: Path) -> None:
    """Precompute-outside without ``ATTNQUANT_QUANT`` serves MAX's stock graph: no NVFP4 head."""
    with pytest.raises(NotImplementedError, match=r"ATTNQUANT_QUANT_HEAD=1.*in-graph path"):
        plan_serving(tiny_dense, ServingOptions(path="precompute-outside", quant_head=True))


def test_quant_head_on_an_in_graph_path_quantizes_the_head_beside_float_theta(
    tiny_dense: Path,
) -> None:
    """In the graph the head is NVFP4 beside float forms too: the theta state's head is the
    reference quantizer's three tensors, the projections' theta tensors float as without it."""
    config = ServingOptions(path="custom-op", quant_head=True)
    plan = plan_serving(tiny_dense, config)
    assert plan.head_nvfp4 and plan.describe().endswith(NVFP4_HEAD)
    state = dict(plan.theta_state())
    without = dict(plan_serving(tiny_dense, replace(config, quant_head=False)).theta_state())
    q = quantize_nvfp4(tiny_llama_tensors()["lm_head.weight"], name="lm_head.weight")
    np.testing.assert_array_equal(state.pop("lm_head.weight"), q.weight)
    np.testing.assert_array_equal(state.pop("lm_head.weight_scale"), q.weight_scale.view(np.uint8))
    np.testing.assert_array_equal(state.pop("lm_head.weight_scale_2"), q.weight_scale_2.reshape(1))
    del without["lm_head.weight"]
    assert state.keys() == without.keys()
    for key, array in state.items():
        np.testing.assert_array_equal(array, without[key], err_msg=key)


def test_tile_state_rewrites_every_nvfp4_weight_once_in_the_tiled_layout() -> None:
    """The state a fused CPU model loads on AVX-512: packed codes and scales of projections
    (``.weight``/``.weight_scale``) and of bands (``W0_packed``/``W0_scale``) tiled, the
    per-tensor scales and every other tensor untouched."""
    from max.graph.weights import WeightData

    from attnquant_kernels.layout import tile_nvfp4
    from attnquant_max.architectures.llama3.model import _tile_state

    rng = np.random.default_rng(0)
    arrays = {
        "layers.0.mlp.down_proj.weight": rng.integers(0, 256, (40, 32), dtype=np.uint8),
        "layers.0.mlp.down_proj.weight_scale": rng.integers(0, 256, (40, 4), dtype=np.uint8),
        "layers.0.mlp.down_proj.weight_scale_2": np.ones(1, np.float32),
        "attnquant.shared.mlp.up_proj.0.W0_packed": rng.integers(0, 256, (32, 8), dtype=np.uint8),
        "attnquant.shared.mlp.up_proj.0.W0_scale": rng.integers(0, 256, (32, 1), dtype=np.uint8),
        "norm.weight": rng.standard_normal(16).astype(np.float32),
    }
    state = {k: WeightData.from_numpy(a, k) for k, a in arrays.items()}
    assert _tile_state(state) == 2
    got = {k: np.from_dlpack(v) for k, v in state.items()}
    for packed, scale in (
        ("layers.0.mlp.down_proj.weight", "layers.0.mlp.down_proj.weight_scale"),
        ("attnquant.shared.mlp.up_proj.0.W0_packed", "attnquant.shared.mlp.up_proj.0.W0_scale"),
    ):
        want_w, want_s = tile_nvfp4(arrays[packed], arrays[scale])
        np.testing.assert_array_equal(got[packed], want_w)
        np.testing.assert_array_equal(got[scale], want_s)
        assert state[packed].name == packed
    for key in ("layers.0.mlp.down_proj.weight_scale_2", "norm.weight"):
        np.testing.assert_array_equal(got[key], arrays[key])


def test_merge_state_holds_qkv_and_gate_up_as_one_weight_each() -> None:
    """The state a fused float32 model loads: each layer's q/k/v and gate/up packed rows and
    scale bytes concatenated in order, their per-tensor scales a float32 row scale, the merged
    per-tensor scale 1; every other tensor untouched. The merged weight dequantizes to the
    members' weights stacked."""
    from max.graph.weights import WeightData

    from attnquant_kernels.testing import nvfp4_dequantize, nvfp4_random
    from attnquant_max.architectures.llama3.graph import GATE_UP, QKV
    from attnquant_max.architectures.llama3.model import _merge_state

    rng = np.random.default_rng(0)
    rows = {"self_attn.q_proj": 32, "self_attn.k_proj": 16, "self_attn.v_proj": 16}
    rows |= {"mlp.gate_proj": 48, "mlp.up_proj": 48, "mlp.down_proj": 32}
    arrays: dict[str, np.ndarray] = {"norm.weight": rng.standard_normal(32).astype(np.float32)}
    for layer in range(2):
        for family, n in rows.items():
            w, ws, _ = nvfp4_random(rng, n, 32)
            prefix = f"layers.{layer}.{family}.weight"
            arrays |= {prefix: w, f"{prefix}_scale": ws}
            arrays[f"{prefix}_scale_2"] = rng.uniform(0.01, 1.0, 1).astype(np.float32)
    state = {k: WeightData.from_numpy(a, k) for k, a in arrays.items()}
    assert _merge_state(state) == 4
    got = {k: np.from_dlpack(v) for k, v in state.items()}
    for layer in range(2):
        for target, families in (("self_attn.qkv_proj", QKV), ("mlp.gate_up_proj", GATE_UP)):
            prefixes = [f"layers.{layer}.{f}.weight" for f in families]
            assert not any(p in got for p in prefixes)
            m = f"layers.{layer}.{target}."
            for suffix, part in (("weight", ""), ("weight_scale", "_scale")):
                want = np.concatenate([arrays[p + part] for p in prefixes])
                np.testing.assert_array_equal(got[m + suffix], want)
            np.testing.assert_array_equal(got[m + "weight_scale_2"], np.ones(1, np.float32))
            s = got[m + "theta_s"]
            assert s.dtype == np.float32
            np.testing.assert_array_equal(
                s,
                np.concatenate(
                    [
                        np.repeat(arrays[p + "_scale_2"], rows[f])
                        for p, f in zip(prefixes, families, strict=True)
                    ]
                ),
            )
            members = [
                nvfp4_dequantize(arrays[p], arrays[p + "_scale"], arrays[p + "_scale_2"])
                for p in prefixes
            ]
            merged = s[:, None] * nvfp4_dequantize(
                got[m + "weight"], got[m + "weight_scale"], got[m + "weight_scale_2"]
            )
            np.testing.assert_allclose(merged, np.concatenate(members), rtol=1e-6, atol=0)
            assert state[m + "theta_s"].name == m + "theta_s"
        down = f"layers.{layer}.mlp.down_proj.weight"
        np.testing.assert_array_equal(got[down], arrays[down])
    np.testing.assert_array_equal(got["norm.weight"], arrays["norm.weight"])


def test_merged_layer_refuses_a_bfloat16_row_scale() -> None:
    from max.dtype import DType
    from max.graph import DeviceRef

    from attnquant_max._nvfp4_layers import NVFP4MergedLinear

    with pytest.raises(ValueError, match="float32 activations only"):
        NVFP4MergedLinear(32, [16, 16], dtype=DType.bfloat16, device=DeviceRef.CPU())


# The NVFP4 linears in a graph (a stacked pair and a lone one, against x @ dequantize(q).T) are
# checked in test_layers.py, as one more branch of the layer graph: one compile instead of two.


@pytest.fixture(scope="module")
def nvfp4_model(tiny_dense: Path) -> Iterator[LoadedModel]:
    with load_tiny(tiny_dense, NVFP4) as model:
        yield model


@pytest.mark.slow
def test_served_nvfp4_is_the_stock_model_on_dequantized_weights(
    nvfp4_model: LoadedModel, dense_model: LoadedModel, tmp_path: Path
) -> None:
    reference_dir = write_tiny_llama(tmp_path / "dequantized", _dequantized_tensors())
    with load_tiny(reference_dir) as reference:  # the stock graph (cached), reference weights
        assert_serves_like(nvfp4_model, reference)


def assert_serves_like(
    model: LoadedModel, reference: LoadedModel, prompts: list[str] = PROMPTS
) -> None:
    """``model`` gives ``reference``'s greedy tokens and its log-probs (to 1e-4) on ``prompts``."""
    for prompt in prompts:
        ids = reference.encode(prompt)
        tokens = greedy_generate(reference, ids, 8)
        assert greedy_generate(model, ids, 8) == tokens
        want = greedy_logprobs(reference, ids, tokens).logprobs
        got = greedy_logprobs(model, ids, tokens).logprobs
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


@pytest.mark.slow
def test_nvfp4_model_holds_packed_bytes(nvfp4_model: LoadedModel, dense_model: LoadedModel) -> None:
    nvfp4_bytes = nvfp4_model.model.pipeline._pipeline_model.weight_bytes
    dense_bytes = dense_model.model.pipeline._pipeline_model.weight_bytes
    elements = LAYERS * sum(o * i for o, i in PROJECTIONS.values())
    # float32 (4 B) -> half a byte per code + one E4M3 byte per 16 + one float32 per tensor.
    packed = elements // 2 + elements // BLOCK_SIZE + 4 * LAYERS * len(PROJECTIONS)
    assert dense_bytes - nvfp4_bytes == 4 * elements - packed
    saved = tiny_llama_tensors()
    assert dense_bytes == sum(a.nbytes for a in saved.values())
