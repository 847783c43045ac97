"""A theta checkpoint whose ``W0`` is NVFP4 (format version 4) served in the graph, packed.

``attnquant decompose --quant nvfp4`` writes each band's ``W0`` as packed E2M1 codes, E4M3 block
scales and a float32 scale, plus each layer's ``s``, ``U``, ``V``. With
``ATTNQUANT_PRECOMPUTE_OUTSIDE=0`` (or ``ATTNQUANT_QUANT=nvfp4``, which must not quantize it a
second time) the served graph holds exactly those bytes and runs each projection as one
``generated_linear_nvfp4`` dispatch (or ``W0`` dequantized in the graph). The served model must
be the stock model on the checkpoint's dense rebuild ``W_eff = s * dequantize(W0) + U V^T``
(precompute-outside, the numpy identity on the dequantized ``W0``).

Plans, states, refusals and layouts build no graph; the decoders are traced, not compiled, from
the checkpoint loaded on precompute-outside (the stock graph, cached with the dense model's);
one whole-model graph (fused, passthrough, rank 16) is compiled, in its own xdist group. The
layers' dequantize form (a band shared by two layers, rank 72) rides in the one layer graph of
``test_layers.py``.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from attnquant_core import FAMILIES, ThetaCheckpoint, decompose_checkpoint, save_theta
from attnquant_core.forms import FamilyTheta
from attnquant_max import AttnquantConfig, LoadedModel, count_matmuls, decoder_graph
from attnquant_max._nvfp4_theta import NVFP4ThetaLayout
from attnquant_max._weights import plan_serving

from .conftest import LAYERS, PROJECTIONS, load_tiny
from .test_nvfp4_serving import assert_serves_like

pytestmark = pytest.mark.xdist_group("nvfp4-theta")  # one worker: the graph, and its fixtures

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# The kernel named explicitly, so that CI compiles one known graph (auto times both forms).
FUSED = AttnquantConfig(precompute_outside=False, nvfp4_kernel="fused")
DEQUANTIZE = replace(FUSED, nvfp4_kernel="dequantize")
RANK = 16  # the tiny k/v projections [32, 64] allow up to 32


@pytest.fixture(scope="module")
def tiny_v4(tiny_dense: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama at passthrough with each ``W0`` in NVFP4 and a rank-16 correction of its
    quantization error: ``s != 1`` and ``U V^T`` at work in every projection."""
    out = tmp_path_factory.mktemp("ckpt") / "v4"
    decompose_checkpoint(tiny_dense, out, blocks="layers", rank=RANK, quant="nvfp4")
    return out


@pytest.fixture(scope="module")
def tiny_v4_g1(tiny_dense: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One NVFP4 ``W0`` shared by both layers of each family (G = 1), rank 8."""
    out = tmp_path_factory.mktemp("ckpt") / "v4_g1"
    decompose_checkpoint(tiny_dense, out, blocks=1, rank=8, quant="nvfp4")
    return out


@pytest.fixture(scope="module")
def tiny_v4_mixed(tiny_v4: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``tiny_v4`` with ``mlp.down_proj`` stored with a float W0 (its dequantization)."""
    model = ThetaCheckpoint.open(tiny_v4).load()
    down = model.families["mlp.down_proj"]
    assert isinstance(down, FamilyTheta)
    families = dict(model.families)
    families["mlp.down_proj"] = FamilyTheta(
        name=down.name, shared=down.shared, bands=down.bands, layers=down.layers
    )
    config = json.loads((tiny_v4 / "config.json").read_text())
    out = tmp_path_factory.mktemp("ckpt") / "v4_mixed"
    save_theta(replace(model, families=families), out, config=config)
    return out


def stored_bytes(directory: Path) -> int:
    """Bytes of every tensor a checkpoint stores, read from the safetensors headers (numpy's
    safetensors reader has no float8, which the NVFP4 block scales are)."""
    total = 0
    for file in directory.glob("*.safetensors"):
        with open(file, "rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(size))
        total += sum(
            end - begin
            for key, entry in header.items()
            if key != "__metadata__"
            for begin, end in [entry["data_offsets"]]
        )
    return total


# -- plans and refusals (no graph) ---------------------------------------------------------------


def test_in_graph_plan_serves_the_packed_w0_and_says_so(tiny_v4: Path) -> None:
    plan = plan_serving(tiny_v4, FUSED)
    assert plan.nvfp4_w0 and plan.in_graph and plan.path == "gemm" and not plan.quantized
    line = plan.describe()
    assert "NVFP4 W0 held packed as stored" in line and "one copy per band" in line
    assert "generated_linear_nvfp4(x, W0_packed, W0_scale, W0_scale_2, s, U, V)" in line
    assert "ATTNQUANT_NVFP4_KERNEL=fused" in line and f"r={RANK}" in line
    assert "dequantized in the graph" in plan_serving(tiny_v4, DEQUANTIZE).describe()


def test_quant_nvfp4_on_a_quantized_checkpoint_serves_it_as_stored(tiny_v4: Path) -> None:
    """``ATTNQUANT_QUANT=nvfp4`` asks for a 4-bit model; the checkpoint is one. Quantizing its
    ``W_eff = s Q(W0) + U V^T`` again would quantize the correction of Q's error away, so the
    stored ``W0`` is served packed with ``s``, ``U``, ``V``: the same plan as in the graph."""
    quant = AttnquantConfig(quant="nvfp4", nvfp4_kernel="fused")
    plan = plan_serving(tiny_v4, quant)
    assert plan.nvfp4_w0 and plan.path == "gemm" and not plan.quantized
    assert "not quantized twice" in plan.describe()
    in_graph = dict(plan_serving(tiny_v4, FUSED).nvfp4_theta_state())
    state = dict(plan.nvfp4_theta_state())
    assert state.keys() == in_graph.keys()
    assert all(np.array_equal(state[k], in_graph[k]) for k in state)


def test_precompute_outside_still_rebuilds_dense(tiny_v4: Path) -> None:
    plan = plan_serving(tiny_v4, AttnquantConfig())
    assert not plan.nvfp4_w0 and not plan.in_graph and plan.path == "precompute-outside"
    assert "rebuilt once at load" in plan.describe()


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (
            AttnquantConfig(precompute_outside=False, gemm=False),
            r"stores W0 in NVFP4 \(.*self_attn\.q_proj.*\); the custom-op path \(ATTNQUANT_GEMM=0"
            r".*Unset ATTNQUANT_GEMM \(or set it to 1\)",
        ),
        (
            AttnquantConfig(precompute=True),
            r"stores W0 in NVFP4.*ATTNQUANT_PRECOMPUTE=1.*Set ATTNQUANT_PRECOMPUTE=0 and "
            r"ATTNQUANT_PRECOMPUTE_OUTSIDE=0",
        ),
        (
            AttnquantConfig(quant="nvfp4", precompute=True),
            r"in-graph precompute \(ATTNQUANT_PRECOMPUTE=1\)",
        ),
    ],
    ids=["custom-op", "precompute", "quant-precompute"],
)
def test_paths_that_would_dequantize_w0_are_refused(
    tiny_v4: Path, config: AttnquantConfig, match: str
) -> None:
    with pytest.raises(NotImplementedError, match=match) as info:
        plan_serving(tiny_v4, config)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("config", [FUSED, AttnquantConfig(quant="nvfp4")], ids=["gemm", "quant"])
def test_families_without_an_nvfp4_w0_are_refused(
    tiny_v4_mixed: Path, config: AttnquantConfig
) -> None:
    with pytest.raises(
        NotImplementedError,
        match=r"but not mlp\.down_proj \(banded, float W0\).*ATTNQUANT_PRECOMPUTE_OUTSIDE=1 and "
        r"ATTNQUANT_QUANT unset",
    ):
        plan_serving(tiny_v4_mixed, config)
    assert not plan_serving(tiny_v4_mixed, AttnquantConfig()).nvfp4_w0  # the dense rebuild


# -- the state and its layout (no graph) ---------------------------------------------------------


@pytest.mark.parametrize("which", ["passthrough", "g1"])
def test_state_holds_the_stored_bytes_and_nothing_dequantized(
    which: str, tiny_v4: Path, tiny_v4_g1: Path
) -> None:
    path = tiny_v4 if which == "passthrough" else tiny_v4_g1
    G = LAYERS if which == "passthrough" else 1
    state = {k.removeprefix("model."): v for k, v in plan_serving(path, FUSED).nvfp4_theta_state()}
    assert sum(a.nbytes for a in state.values()) == stored_bytes(path)
    assert not any(k.endswith(tuple(f"{f}.weight" for f in FAMILIES)) for k in state)
    ckpt = ThetaCheckpoint.open(path)
    for family, (out_dim, in_dim) in PROJECTIONS.items():
        for band in range(G):
            packed, scale, scale_2 = (
                state[f"attnquant.shared.{family}.{band}.W0_{part}"]
                for part in ("packed", "scale", "scale_2")
            )
            assert (packed.dtype, packed.shape) == (np.uint8, (out_dim, in_dim // 2))
            assert (scale.dtype, scale.shape) == (np.uint8, (out_dim, in_dim // 16))
            assert (scale_2.dtype, scale_2.shape) == (np.float32, (1,))
            q = ckpt.nvfp4(family, band)
            np.testing.assert_array_equal(packed, q.weight)
            np.testing.assert_array_equal(scale, q.weight_scale.view(np.uint8))
        assert f"attnquant.shared.{family}.{G}.W0_packed" not in state
    layout = NVFP4ThetaLayout.from_state({k: v.shape for k, v in state.items()}, FAMILIES)
    assert layout is not None
    assert layout.blocks == dict.fromkeys(FAMILIES, G)
    assert layout.ranks["mlp.up_proj"] == (RANK if G == LAYERS else 8,) * LAYERS
    theta = {k for k in state if k.startswith("attnquant.") or ".theta_" in k}
    assert layout.keys() == theta


def test_layout_refuses_a_state_without_every_family() -> None:
    shapes = {
        "attnquant.shared.self_attn.q_proj.0.W0_packed": (64, 32),
        "layers.0.self_attn.q_proj.theta_s": (64,),
    }
    with pytest.raises(ValueError, match=r"missing \['self_attn\.k_proj'"):
        NVFP4ThetaLayout.from_state(shapes, FAMILIES)
    assert NVFP4ThetaLayout.from_state({"layers.0.x.weight": (4, 4)}, FAMILIES) is None


# -- traced decoders (no compile) -------------------------------------------------------------


@pytest.fixture(scope="module")
def outside_v4(tiny_v4: Path) -> Iterator[LoadedModel]:
    """The checkpoint rebuilt dense at load (the reference): the stock graph, cached."""
    with load_tiny(tiny_v4) as model:
        yield model


def _text(loaded: LoadedModel, config: AttnquantConfig) -> tuple[str, int]:
    graph, nbytes = decoder_graph(loaded, config)
    return str(graph), nbytes


@pytest.mark.slow
def test_traced_decoders_hold_the_checkpoint_bytes(
    outside_v4: LoadedModel, tiny_v4: Path, tiny_dense: Path, dense_model: LoadedModel
) -> None:
    """Fused: one generated_linear_nvfp4 per projection, no matmul but the head; dequantize:
    one matmul per group plus two per correction; both hold the checkpoint's bytes, and
    ``ATTNQUANT_QUANT=nvfp4`` builds the very graph of the in-graph path."""
    fused, fused_bytes = _text(outside_v4, FUSED)
    assert fused.count('"generated_linear_nvfp4"') == len(PROJECTIONS) * LAYERS
    assert sum(count_matmuls(fused).values()) == 1  # the LM head
    deq, deq_bytes = _text(outside_v4, DEQUANTIZE)
    assert '"generated_linear_nvfp4"' not in deq
    per_layer = 4 + 2 * len(PROJECTIONS)  # qkv, o, gate_up, down + (x V) U^T each
    assert sum(count_matmuls(deq).values()) == 1 + per_layer * LAYERS
    quant, quant_bytes = _text(outside_v4, AttnquantConfig(quant="nvfp4", nvfp4_kernel="fused"))
    assert quant == fused
    stored = stored_bytes(tiny_v4)
    assert fused_bytes == deq_bytes == quant_bytes == stored
    dense = dense_model.model.pipeline._pipeline_model.weight_bytes
    assert dense == stored_bytes(tiny_dense)
    print(f"tiny Llama, NVFP4 W0 + r={RANK} in the graph: {stored} B held, dense {dense} B")


@pytest.mark.slow
def test_traced_decoder_holds_each_band_once(tiny_v4_g1: Path) -> None:
    with load_tiny(tiny_v4_g1) as outside:  # the stock graph, cached
        text, nbytes = _text(outside, FUSED)
    assert nbytes == stored_bytes(tiny_v4_g1)
    for family in FAMILIES:
        for part in ("packed", "scale", "scale_2"):
            assert text.count(f'"attnquant.shared.{family}.0.W0_{part}"') == 1, (family, part)
    assert text.count('"generated_linear_nvfp4"') == len(PROJECTIONS) * LAYERS


# -- the served model (one whole-model graph) ----------------------------------------------------


@pytest.mark.slow
def test_served_v4_on_the_fused_op_is_the_stock_model_on_the_dense_rebuild(
    tiny_v4: Path, outside_v4: LoadedModel
) -> None:
    """Greedy tokens equal and log-probs to 1e-4 against ``s * dequantize(W0) + U V^T`` rebuilt
    in numpy at load (precompute-outside), holding the checkpoint's bytes."""
    from attnquant_max import ThetaLlama3Model

    with load_tiny(tiny_v4, FUSED) as model:
        pm = model.model.pipeline._pipeline_model
        assert isinstance(pm, ThetaLlama3Model)
        assert pm.weight_bytes == stored_bytes(tiny_v4)
        assert not any(k.endswith("q_proj.weight") for k in pm.state_dict)
        assert "attnquant.shared.self_attn.q_proj.1.W0_packed" in pm.state_dict
        assert "layers.1.mlp.down_proj.theta_U" in pm.state_dict
        assert_serves_like(model, outside_v4)
