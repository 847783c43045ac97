"""A theta checkpoint whose ``W0`` is NVFP4 (format version 4) served in the graph, packed, alone or
mixed with the float forms a ``--budget --quant nvfp4`` fit writes.

``attnquant decompose --quant nvfp4`` writes each band's ``W0`` as packed E2M1 codes, E4M3 block
scales and a float32 scale, plus each layer's ``s``, ``U``, ``V``. With
``ATTNQUANT_PRECOMPUTE_OUTSIDE=0`` (or ``ATTNQUANT_QUANT=nvfp4``, which must not quantize it a
second time) the served graph holds exactly those bytes and runs each projection as one
``generated_linear_nvfp4`` dispatch (or ``W0`` dequantized in the graph). The served model must
be the stock model on the checkpoint's dense rebuild ``W_eff = s * dequantize(W0) + U V^T``
(precompute-outside, the numpy identity on the dequantized ``W0``).

Plans, states, refusals and layouts build no graph; the decoders are traced, not compiled, from
the checkpoint loaded on precompute-outside (the stock graph, cached with the dense model's).
One whole-model graph is compiled, in its own xdist group: a MIXED checkpoint (:func:`tiny_mixed`:
q/k/o banded with an NVFP4 W0 at passthrough, r = 16, on the fused op; v and gate/up low rank;
down a shared basis), so it proves the NVFP4 theta path and its mixing with the GEMM path's
float forms in one graph (q/k/v a group mixing NVFP4 and float members, gate/up one stacked
first matmul). The layers' dequantize form (a band shared by two layers, rank 72) rides in the
one layer graph of ``test_layers.py``.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from attnquant_core import (
    FAMILIES,
    LowRankFamily,
    SharedBasisFamily,
    ThetaCheckpoint,
    ThetaModel,
    decompose_checkpoint,
    decompose_family,
    open_checkpoint,
    save_theta,
)
from attnquant_core.forms import FamilyTheta
from attnquant_core.serving import InGraphLayout
from attnquant_kernels.layout import cpu_prefers_tiled
from attnquant_max import LoadedModel, ServingOptions, count_matmuls, decoder_graph, plan_serving
from attnquant_max.testing import VOCAB

from .conftest import HIDDEN, LAYERS, PROJECTIONS, load_tiny
from .test_nvfp4_serving import assert_serves_like

pytestmark = pytest.mark.xdist_group("nvfp4-theta")  # one worker: the graph, and its fixtures

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# The kernel named explicitly, so that CI compiles one known graph (auto times both forms).
FUSED = ServingOptions(path="in-graph", nvfp4_kernel="fused")
#: The op a fused CPU graph names: on AVX-512 the tiled layout's with int8 decode steps
#: (``nvfp4_tiled``, ``nvfp4_int8``: the defaults).
FUSED_OP = f'"generated_linear_nvfp4{"_tiled_a8" if cpu_prefers_tiled() else ""}"'
DEQUANTIZE = replace(FUSED, nvfp4_kernel="dequantize")
RANK = 16  # the tiny k/v projections [32, 64] allow up to 32
#: The mixed checkpoint's families banded with an NVFP4 W0 (passthrough, rank RANK); the others
#: are float: v low rank (r = 8), gate/up low rank (r = 16), down a shared basis (width 24).
MIXED_NVFP4 = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.o_proj")
MIXED_FLOAT = {
    "self_attn.v_proj": ("lowrank", 8),
    "mlp.gate_proj": ("lowrank", 16),
    "mlp.up_proj": ("lowrank", 16),
    "mlp.down_proj": ("shared_basis", 24),
}


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
def tiny_v4_float_down(tiny_v4: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``tiny_v4`` with ``mlp.down_proj`` stored with a float W0 (its dequantization)."""
    model = ThetaCheckpoint.open(tiny_v4).load()
    down = model.families["mlp.down_proj"]
    assert isinstance(down, FamilyTheta)
    families = dict(model.families)
    families["mlp.down_proj"] = FamilyTheta(
        name=down.name, shared=down.shared, bands=down.bands, layers=down.layers
    )
    config = json.loads((tiny_v4 / "config.json").read_text())
    out = tmp_path_factory.mktemp("ckpt") / "v4_float_down"
    save_theta(replace(model, families=families), out, config=config)
    return out


def mixed_model(dense: Path) -> ThetaModel:
    """The tiny Llama with fixed forms (no budget search): :data:`MIXED_NVFP4` banded with an
    NVFP4 W0 at passthrough (``decompose_family(quant="nvfp4")``), :data:`MIXED_FLOAT` low rank
    (the truncated SVD of each weight) or a shared basis on the input side (one band: the top
    right singular vectors of the layers' stacked weights, each layer's coefficients ``W_l B``),
    all float32."""
    ckpt = open_checkpoint(dense)
    tensors = {key: ckpt.get(key) for key in ckpt.keys()}
    families: dict[str, Any] = {}
    for name, info in ckpt.families.items():
        weights = [np.asarray(tensors.pop(key), np.float32) for key in info.keys]
        if name in MIXED_NVFP4:
            families[name], _ = decompose_family(
                weights, blocks="layers", rank=RANK, name=name, quant="nvfp4"
            )
            continue
        form, r = MIXED_FLOAT[name]
        if form == "lowrank":
            svds = [np.linalg.svd(W, full_matrices=False) for W in weights]
            families[name] = LowRankFamily(
                name=name,
                U=tuple(np.ascontiguousarray(u[:, :r] * s[:r]) for u, s, _ in svds),
                V=tuple(np.ascontiguousarray(vt[:r].T) for _, _, vt in svds),
            )
        else:
            B = np.ascontiguousarray(np.linalg.svd(np.concatenate(weights))[2][:r].T)
            families[name] = SharedBasisFamily(
                name=name,
                side="in",
                bases=(B,),
                bands=(0,) * len(weights),
                coefs=tuple(np.ascontiguousarray(W @ B) for W in weights),
            )
    return ThetaModel(families=families, stack=ckpt.stack, extra=tensors)


@pytest.fixture(scope="module")
def tiny_mixed(tiny_dense: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """:func:`mixed_model` written as a theta checkpoint (format version 4)."""
    out = tmp_path_factory.mktemp("ckpt") / "mixed"
    config = json.loads((tiny_dense / "config.json").read_text())
    save_theta(mixed_model(tiny_dense), out, config=config, source_dir=tiny_dense)
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
    assert "--nvfp4-kernel fused" in line and f"r={RANK}" in line
    assert "dequantized in the graph" in plan_serving(tiny_v4, DEQUANTIZE).describe()


def test_quant_nvfp4_on_a_quantized_checkpoint_serves_it_as_stored(tiny_v4: Path) -> None:
    """``ATTNQUANT_QUANT=nvfp4`` asks for a 4-bit model; the checkpoint is one. Quantizing its
    ``W_eff = s Q(W0) + U V^T`` again would quantize the correction of Q's error away, so the
    stored ``W0`` is served packed with ``s``, ``U``, ``V``: the same plan as in the graph."""
    quant = ServingOptions(path="precompute-outside", quant="nvfp4", nvfp4_kernel="fused")
    plan = plan_serving(tiny_v4, quant)
    assert plan.nvfp4_w0 and plan.path == "gemm" and not plan.quantized
    assert "not quantized twice" in plan.describe()
    in_graph = dict(plan_serving(tiny_v4, FUSED).theta_state())
    state = dict(plan.theta_state())
    assert state.keys() == in_graph.keys()
    assert all(np.array_equal(state[k], in_graph[k]) for k in state)


def test_precompute_outside_still_rebuilds_dense(tiny_v4: Path) -> None:
    plan = plan_serving(tiny_v4, ServingOptions(path="precompute-outside"))
    assert not plan.nvfp4_w0 and not plan.in_graph and plan.path == "precompute-outside"
    assert "rebuilt once at load" in plan.describe()


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (
            ServingOptions(path="custom-op"),
            r"stores W0 in NVFP4 \(.*self_attn\.q_proj.*\); the custom-op path \(--path custom-op"
            r".*Pass --path gemm \(or auto\)",
        ),
        (
            ServingOptions(path="precompute"),
            r"stores W0 in NVFP4.*--path precompute.*Pass --path gemm to serve W0 packed",
        ),
        (
            ServingOptions(path="precompute", quant="nvfp4"),
            r"in-graph precompute \(--path precompute\)",
        ),
    ],
    ids=["custom-op", "precompute", "quant-precompute"],
)
def test_paths_that_would_dequantize_w0_are_refused(
    tiny_v4: Path, config: ServingOptions, match: str
) -> None:
    with pytest.raises(NotImplementedError, match=match) as info:
        plan_serving(tiny_v4, config)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "config",
    [FUSED, ServingOptions(path="precompute-outside", quant="nvfp4")],
    ids=["gemm", "quant"],
)
def test_a_mixed_checkpoint_is_planned_in_one_graph_and_says_what_each_form_runs_as(
    tiny_mixed: Path, config: ServingOptions
) -> None:
    """NVFP4-W0 families beside low rank and shared basis: one in-graph plan (no refusal), whose
    start-up line names the NVFP4 families, how they run, and the float forms' counts."""
    plan = plan_serving(tiny_mixed, config)
    assert plan.nvfp4_families == tuple(sorted(MIXED_NVFP4))
    assert plan.nvfp4_w0 and plan.in_graph and plan.path == "gemm" and not plan.quantized
    line = plan.describe()
    assert "holding its stored bytes" in line and "\n" not in line
    names = "self_attn.k_proj, self_attn.o_proj, self_attn.q_proj"
    assert f"3 families ({names}) banded with an NVFP4 W0" in line
    assert "NVFP4 W0 held packed as stored" in line and "one copy per band" in line
    assert "3 lowrank, 1 shared_basis on the GEMM path as stored" in line
    assert "per member in a group with an NVFP4 member" in line
    precompute_outside = plan_serving(tiny_mixed, ServingOptions(path="precompute-outside"))
    assert not precompute_outside.nvfp4_w0 and precompute_outside.path == "precompute-outside"


def test_a_float_w0_banded_family_beside_nvfp4_ones_is_served_banded(
    tiny_v4_float_down: Path,
) -> None:
    plan = plan_serving(tiny_v4_float_down, FUSED)
    assert "mlp.down_proj" not in plan.nvfp4_families and len(plan.nvfp4_families) == 6
    assert "1 banded (float W0) on the GEMM path as stored" in plan.describe()
    state = {k.removeprefix("model."): v for k, v in plan.theta_state()}
    assert "attnquant.gemm.mlp.down_proj.0.W0V" in state
    assert "attnquant.shared.mlp.down_proj.0.W0_packed" not in state
    layout = InGraphLayout.from_state({k: v.shape for k, v in state.items()}, FAMILIES, fuse=True)
    assert layout is not None and set(layout.forms["mlp.down_proj"]) == {"banded"}
    assert set(layout.forms["mlp.up_proj"]) == {"nvfp4"}


# -- the state and its layout (no graph) ---------------------------------------------------------


@pytest.mark.parametrize("which", ["passthrough", "g1"])
def test_state_holds_the_stored_bytes_and_nothing_dequantized(
    which: str, tiny_v4: Path, tiny_v4_g1: Path
) -> None:
    path = tiny_v4 if which == "passthrough" else tiny_v4_g1
    G = LAYERS if which == "passthrough" else 1
    state = {k.removeprefix("model."): v for k, v in plan_serving(path, FUSED).theta_state()}
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
    layout = InGraphLayout.from_state({k: v.shape for k, v in state.items()}, FAMILIES, fuse=True)
    assert layout is not None and layout.gemm and layout.blocks == G and not layout.groups
    assert layout.nvfp4_shapes == PROJECTIONS
    assert {b.band for b in layout.served["mlp.up_proj"]} == set(range(G))
    assert layout.served["mlp.up_proj"][0].rank == (RANK if G == LAYERS else 8)
    assert all(set(kinds) == {"nvfp4"} for kinds in layout.forms.values())
    theta = {k for k in state if k.startswith("attnquant.") or ".theta_" in k}
    assert layout.keys(LAYERS) == theta


def test_mixed_state_holds_the_stored_bytes_each_form_as_the_gemm_path_serves_it(
    tiny_mixed: Path,
) -> None:
    state = {k.removeprefix("model."): v for k, v in plan_serving(tiny_mixed, FUSED).theta_state()}
    assert sum(a.nbytes for a in state.values()) == stored_bytes(tiny_mixed)
    assert not any(k.endswith(tuple(f"{f}.weight" for f in FAMILIES)) for k in state)
    layout = InGraphLayout.from_state({k: v.shape for k, v in state.items()}, FAMILIES, fuse=True)
    assert layout is not None and layout.gemm and not layout.groups
    assert set(layout.nvfp4_shapes) == set(MIXED_NVFP4)
    forms = {name: set(kinds) for name, kinds in layout.forms.items()}
    assert forms == {
        **{name: {"nvfp4"} for name in MIXED_NVFP4},
        "self_attn.v_proj": {"lowrank"},
        "mlp.gate_proj": {"lowrank"},
        "mlp.up_proj": {"lowrank"},
        "mlp.down_proj": {"basis_in"},
    }
    # gate/up (both low rank): one stacked first matmul; q/k/v (mixed): each member alone.
    assert layout.stacked == {"mlp.gate_up_proj": tuple(range(LAYERS))}
    assert "layers.0.mlp.gate_up_proj.theta_in" in state
    assert "layers.0.self_attn.qkv_proj.theta_in" not in state
    theta = {k for k in state if k.startswith("attnquant.") or ".theta_" in k}
    assert layout.keys(LAYERS) == theta


def test_layout_refuses_a_state_without_every_family() -> None:
    shapes = {
        "attnquant.shared.self_attn.q_proj.0.W0_packed": (64, 32),
        "layers.0.self_attn.q_proj.theta_s": (64,),
    }
    with pytest.raises(ValueError, match=r"missing \['self_attn\.k_proj'"):
        InGraphLayout.from_state(shapes, FAMILIES, fuse=True)
    assert InGraphLayout.from_state({"layers.0.x.weight": (4, 4)}, FAMILIES, fuse=True) is None


# -- traced decoders (no compile) -------------------------------------------------------------


@pytest.fixture(scope="module")
def outside_v4(tiny_v4: Path) -> Iterator[LoadedModel]:
    """The checkpoint rebuilt dense at load (the reference): the stock graph, cached."""
    with load_tiny(tiny_v4) as model:
        yield model


def _text(loaded: LoadedModel, config: ServingOptions) -> tuple[str, int]:
    graph, nbytes = decoder_graph(loaded, config)
    return str(graph), nbytes


@pytest.mark.slow
def test_traced_decoders_hold_the_checkpoint_bytes(
    outside_v4: LoadedModel, tiny_v4: Path, tiny_dense: Path, dense_model: LoadedModel
) -> None:
    """Fused (on the CPU): one generated_linear_nvfp4 per projection at every batch, no branch
    and no matmul but the head's; dequantize: one matmul per group plus two per correction;
    both hold the checkpoint's bytes, and ``ATTNQUANT_QUANT=nvfp4`` builds the very graph of
    the in-graph path."""
    fused, fused_bytes = _text(outside_v4, FUSED)
    assert fused.count(FUSED_OP) == len(PROJECTIONS) * LAYERS
    assert '"nvfp4_dequantize"' not in fused and "mo.if" not in fused
    deq, deq_bytes = _text(outside_v4, DEQUANTIZE)
    assert '"generated_linear_nvfp4' not in deq and '"nvfp4_dequantize"' not in deq
    per_layer = 4 + 2 * len(PROJECTIONS)  # qkv, o, gate_up, down + (x V) U^T each
    assert sum(count_matmuls(deq).values()) == 1 + per_layer * LAYERS
    assert sum(count_matmuls(fused).values()) == 1
    quant, quant_bytes = _text(
        outside_v4, ServingOptions(path="precompute-outside", quant="nvfp4", nvfp4_kernel="fused")
    )
    assert quant == fused
    stored = stored_bytes(tiny_v4)
    assert fused_bytes == deq_bytes == quant_bytes == stored
    dense = dense_model.model.pipeline._pipeline_model.weight_bytes
    assert dense == stored_bytes(tiny_dense)
    print(f"tiny Llama, NVFP4 W0 + r={RANK} in the graph: {stored} B held, dense {dense} B")


@pytest.mark.slow
def test_traced_decoder_with_the_head_in_nvfp4(outside_v4: LoadedModel, tiny_v4: Path) -> None:
    """``ATTNQUANT_QUANT_HEAD=1`` beside the stored NVFP4 ``W0``: the head is one more fused
    dispatch (no matmul left in the graph), held in 4.5 bits per weight instead of float32."""
    head = replace(FUSED, quant_head=True)
    assert plan_serving(tiny_v4, head).head_nvfp4
    text, nbytes = _text(outside_v4, head)
    assert text.count(FUSED_OP) == len(PROJECTIONS) * LAYERS + 1
    assert sum(count_matmuls(text).values()) == 0
    weights = VOCAB * HIDDEN
    nvfp4 = weights // 2 + weights // 16 + 4  # codes, E4M3 block scales, per-tensor scale
    assert nbytes == stored_bytes(tiny_v4) - 4 * weights + nvfp4


@pytest.mark.slow
def test_traced_decoder_holds_each_band_once(tiny_v4_g1: Path) -> None:
    with load_tiny(tiny_v4_g1) as outside:  # the stock graph, cached
        text, nbytes = _text(outside, FUSED)
    assert nbytes == stored_bytes(tiny_v4_g1)
    for family in FAMILIES:
        for part in ("packed", "scale", "scale_2"):
            assert text.count(f'"attnquant.shared.{family}.0.W0_{part}"') == 1, (family, part)
    assert text.count(FUSED_OP) == len(PROJECTIONS) * LAYERS


@pytest.fixture(scope="module")
def outside_mixed(tiny_mixed: Path) -> Iterator[LoadedModel]:
    """The mixed checkpoint rebuilt dense at load (the reference): the stock graph, cached."""
    with load_tiny(tiny_mixed) as model:
        yield model


@pytest.mark.slow
def test_traced_mixed_decoders_run_each_form_as_stored(
    outside_mixed: LoadedModel, tiny_mixed: Path
) -> None:
    """Fused (on the CPU): one generated_linear_nvfp4 per NVFP4 projection (q, k, o) at every
    batch; two matmuls for v and
    for down, three for gate/up (one stacked first matmul, each U); dequantize: each NVFP4
    projection one matmul plus two for its correction, q and k each alone (their group mixes
    NVFP4 and float members). Both hold the checkpoint's stored bytes."""
    fused, fused_bytes = _text(outside_mixed, FUSED)
    assert fused.count(FUSED_OP) == len(MIXED_NVFP4) * LAYERS
    assert '"nvfp4_dequantize"' not in fused and "mo.if" not in fused
    float_matmuls = 2 + 3 + 2  # v; gate/up; down
    assert sum(count_matmuls(fused).values()) == 1 + float_matmuls * LAYERS
    per_layer = float_matmuls + 3 * len(MIXED_NVFP4)
    deq, deq_bytes = _text(outside_mixed, DEQUANTIZE)
    assert '"generated_linear_nvfp4' not in deq and '"nvfp4_dequantize"' not in deq
    assert sum(count_matmuls(deq).values()) == 1 + per_layer * LAYERS
    assert fused_bytes == deq_bytes == stored_bytes(tiny_mixed)


# -- the served model (one whole-model graph) ----------------------------------------------------


@pytest.mark.slow
def test_served_mixed_checkpoint_on_the_fused_op_is_the_stock_model_on_the_dense_rebuild(
    tiny_mixed: Path, outside_mixed: LoadedModel, dense_model: LoadedModel
) -> None:
    """NVFP4-W0 families (fused op) and float forms (GEMM path) in one graph: greedy tokens equal
    and log-probs to 1e-4 against every family rebuilt in numpy at load (precompute-outside:
    ``s * dequantize(W0) + U V^T``, ``U V^T``, ``U B^T``), holding the checkpoint's bytes. Float
    activations (``--no-nvfp4-int8``): the int8 decode steps are not exact, and are judged in
    test_nvfp4_kernel against the float op."""
    from attnquant_max import ThetaLlama3Model

    with load_tiny(tiny_mixed, replace(FUSED, nvfp4_int8=False)) as model:
        pm = model.model.pipeline._pipeline_model
        assert isinstance(pm, ThetaLlama3Model)
        held = pm.weight_bytes
        assert held == stored_bytes(tiny_mixed)
        assert not any(k.endswith("_proj.weight") for k in pm.state_dict)
        assert "attnquant.shared.self_attn.q_proj.1.W0_packed" in pm.state_dict
        assert "layers.1.self_attn.o_proj.theta_U" in pm.state_dict
        assert "layers.1.self_attn.v_proj.theta_V" in pm.state_dict
        assert "layers.1.mlp.gate_up_proj.theta_in" in pm.state_dict
        assert "attnquant.shared.mlp.down_proj.0.basis" in pm.state_dict
        assert_serves_like(model, outside_mixed)
    dense = dense_model.model.pipeline._pipeline_model.weight_bytes
    print(
        f"tiny Llama, mixed (NVFP4 W0 + r={RANK}; float forms) in the graph: {held} B, "
        f"dense {dense} B"
    )
